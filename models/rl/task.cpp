// models/rl/task.cpp -- datasets, verifiers, built-in arithmetic.
#include "models/rl/task.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "models/json_io.hpp"
#include "models/params.hpp"

namespace fp8rl::models {

dataset dataset_load_jsonl(const std::string& path) {
  if (std::filesystem::is_directory(path)) throw std::invalid_argument(path + ": is a directory, not a JSONL file");
  std::ifstream f(path);
  if (!f) throw std::invalid_argument(open_failure(path));
  dataset d;
  d.source = path;
  std::string line;
  jsonl_errors errors(path);
  int64_t n = 0;
  while (std::getline(f, line)) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto bad = [&](const std::string& why) { errors.add(path + ":" + std::to_string(n) + ": " + why); };
    nlohmann::json j;
    try {
      j = json_parse_strict(line, "");
    } catch (const std::invalid_argument& e) {
      bad(e.what());
      continue;
    }
    if (!j.is_object()) { bad("not a JSON object"); continue; }
    if (!j.contains("prompt") || !j["prompt"].is_string()) { bad("'prompt' missing or not a string"); continue; }
    if (!j.contains("answer") || !(j["answer"].is_string() || j["answer"].is_number())) {
      bad("'answer' missing or not a string/number");
      continue;
    }
    task_example e;
    e.line = n;
    e.prompt = j["prompt"].get<std::string>();
    e.answer = j["answer"].is_string() ? j["answer"].get<std::string>() : j["answer"].dump();
    if (e.prompt.find_first_not_of(" \t\r\n") == std::string::npos) { bad("'prompt' is empty or blank"); continue; }
    // an answer with nothing to compare (after normalization) rewards a completion that says nothing
    if (answer_normalize(e.answer).empty()) { bad("'answer' " + j["answer"].dump() + " is empty once normalized"); continue; }
    d.items.push_back(std::move(e));
  }
  errors.throw_if_any();
  if (d.items.empty()) throw std::invalid_argument(path + ": no examples");
  return d;
}

std::string example_where(const dataset& d, size_t i) {
  const int64_t line = d.items.at(i).line;
  return line > 0 ? d.source + ":" + std::to_string(line) : d.source + " example " + std::to_string(i);
}

std::string dataset_fingerprint(const dataset& d) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&](std::string_view s) {
    for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
    h = (h ^ 0xffu) * 0x100000001b3ull;  // a byte no UTF-8 text holds ends each field: ("ab", "c") != ("a", "bc")
  };
  for (const auto& e : d.items) {
    mix(e.prompt);
    mix(e.answer);
  }
  char out[17];
  std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
  return out;
}

std::optional<verifier_kind> verifier_parse(std::string_view s) {
  if (s == "exact") return verifier_kind::exact;
  if (s == "numeric") return verifier_kind::numeric;
  return std::nullopt;
}

std::string answer_normalize(std::string_view s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c))) { space = !out.empty(); continue; }
    if (space) out += ' ';
    space = false;
    out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

namespace {
std::optional<double> parse_number(std::string_view s) {
  std::string t;
  for (char c : answer_normalize(s))
    if (c != ',') t += c;
  if (!t.empty() && t[0] == '+') t.erase(0, 1);
  if (t.empty()) return std::nullopt;
  try {
    size_t pos = 0;
    double v = std::stod(t, &pos);
    if (pos != t.size() || !std::isfinite(v)) return std::nullopt;
    return v;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}
}  // namespace

float verify(verifier_kind k, std::string_view response, std::string_view answer) {
  if (k == verifier_kind::exact) return answer_normalize(response) == answer_normalize(answer) ? 1.0f : 0.0f;
  auto r = parse_number(response), a = parse_number(answer);
  if (!r || !a) return 0.0f;
  return std::fabs(*r - *a) <= 1e-6 * std::max(1.0, std::fabs(*a)) ? 1.0f : 0.0f;
}

bool answer_is_number(std::string_view answer) { return parse_number(answer).has_value(); }

std::vector<std::string> answer_forms(verifier_kind k, std::string_view answer) {
  const size_t b = answer.find_first_not_of(" \t\n\r"), e = answer.find_last_not_of(" \t\n\r");
  const std::string trimmed(b == std::string_view::npos ? std::string_view() : answer.substr(b, e - b + 1));
  if (k == verifier_kind::exact) return {trimmed, answer_normalize(answer)};
  const auto v = parse_number(answer);
  if (!v) return {trimmed};
  char buf[400];  // DBL_MAX in fixed notation: 309 digits
  const auto fixed = std::to_chars(buf, buf + sizeof buf, *v, std::chars_format::fixed);  // the shortest that round-trips
  std::vector<std::string> out = {std::string(buf, fixed.ptr)};
  const auto any = std::to_chars(buf, buf + sizeof buf, *v);  // fixed or scientific, the shorter: 1e+30
  if (std::string(buf, any.ptr) != out[0]) out.emplace_back(buf, any.ptr);
  return out;
}

std::string arithmetic_alphabet() { return "0123456789+*="; }

dataset arithmetic_dataset(const arithmetic_config& c, bool validation, int64_t n, uint64_t seed) {
  if (c.op != '+' && c.op != '*') throw std::invalid_argument("arithmetic: op must be '+' or '*'");
  if (c.digits < 1 || c.digits > 6) throw std::invalid_argument("arithmetic: digits must be 1..6");
  int64_t lo = 1, hi = 10;
  for (int i = 1; i < c.digits; ++i) { lo *= 10; hi *= 10; }
  if (c.digits == 1) lo = 0;
  const uint64_t buckets = 1000, val_buckets = static_cast<uint64_t>(c.val_fraction * buckets);
  dataset d;
  // the task's name as given (task_spec_parse), and the split: errors name "builtin:add2 (train) example 4"
  d.source = std::string(c.op == '+' ? "builtin:add" : "builtin:mul") + std::to_string(c.digits) +
             (validation ? " (validation)" : " (train)");
  rng g(seed ^ (validation ? 0x5bd1e995ull : 0x1b873593ull));
  int64_t guard = 0;
  while (static_cast<int64_t>(d.items.size()) < n) {
    if (++guard > n * 1000) throw std::invalid_argument("arithmetic: cannot draw enough distinct examples");
    const int64_t a = lo + static_cast<int64_t>(g.next_u64() % static_cast<uint64_t>(hi - lo));
    const int64_t b = lo + static_cast<int64_t>(g.next_u64() % static_cast<uint64_t>(hi - lo));
    rng h(static_cast<uint64_t>(a) * 1000003ull + static_cast<uint64_t>(b));
    const bool is_val = h.next_u64() % buckets < val_buckets;
    if (is_val != validation) continue;
    const int64_t r = c.op == '+' ? a + b : a * b;
    d.items.push_back({std::to_string(a) + c.op + std::to_string(b) + "=", std::to_string(r)});
  }
  return d;
}

task_spec task_spec_parse(const std::string& s) {
  task_spec t;
  if (s.rfind("builtin:", 0) != 0) {
    t.path = s;
    return t;
  }
  const std::string b = s.substr(8);
  if (b.size() != 4 || (b.substr(0, 3) != "add" && b.substr(0, 3) != "mul") || b[3] < '1' || b[3] > '6')
    throw std::invalid_argument("task '" + s + "': built-in tasks are builtin:add1..add6 and builtin:mul1..mul6");
  t.builtin = true;
  t.arith.op = b[0] == 'a' ? '+' : '*';
  t.arith.digits = b[3] - '0';
  return t;
}

dataset task_load(const task_spec& t, bool validation, int64_t n, uint64_t seed) {
  if (t.builtin) return arithmetic_dataset(t.arith, validation, n, seed);
  return dataset_load_jsonl(t.path);
}

}  // namespace fp8rl::models
