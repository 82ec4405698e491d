// tools/cli/args.cpp -- strict option parsing.
#include "tools/cli/args.hpp"

#include <fmt/format.h>

#include <cstdio>

namespace fp8rl::cli {

std::optional<long long> int_of(const std::string& t) {
  try {
    size_t pos = 0;
    const long long v = std::stoll(t, &pos);
    if (pos == t.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

long long args::get_int(const std::string& k, long long def, long long lo, long long hi) const {
  if (!has(k)) return def;
  const auto parsed = int_of(kv.at(k));
  if (!parsed) throw std::invalid_argument("option --" + k + ": '" + kv.at(k) + "' is not an integer (or out of range)");
  const long long v = *parsed;
  if (v < lo || v > hi)
    throw std::invalid_argument("option --" + k + ": " + std::to_string(v) + " is outside [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "]");
  return v;
}


double args::get_num(const std::string& k, double def, double lo, double hi) const {
  if (!has(k)) return def;
  double v = 0;
  try {
    size_t pos = 0;
    v = std::stod(kv.at(k), &pos);
    if (pos != kv.at(k).size()) throw std::invalid_argument("");
  } catch (const std::exception&) {
    throw std::invalid_argument("option --" + k + ": '" + kv.at(k) + "' is not a number");
  }
  if (!(v >= lo && v <= hi))  // NaN fails too
    throw std::invalid_argument("option --" + k + ": " + kv.at(k) + " is outside [" + fmt::format("{}, {}", lo, hi) + "]");  // shortest round-trip: 1e-12, 10
  return v;
}

args args_parse(int argc, char** argv, int first, const std::set<std::string>& valued,
                const std::set<std::string>& switches, const char* usage) {
  const std::string help = usage;
  for (const auto* opts : {&valued, &switches})
    for (const auto& k : *opts)
      if (help.find("--" + k) == std::string::npos) throw std::logic_error("usage text lacks option --" + k);
  args a;
  for (int i = first; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") {
      std::fputs(usage, stdout);
      throw help_shown{};
    }
    if (s.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + s + "' (--help lists the options)");
    std::string key = s.substr(2), val;
    const auto eq = key.find('=');
    const bool inline_val = eq != std::string::npos;
    if (inline_val) {
      val = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    if (a.flags.count(key) || a.kv.count(key)) throw std::invalid_argument("option --" + key + " given twice");
    if (switches.count(key)) {
      if (inline_val) throw std::invalid_argument("option --" + key + " takes no value");
      a.flags.insert(key);
    } else if (valued.count(key)) {
      if (!inline_val) {
        if (i + 1 >= argc) throw std::invalid_argument("option --" + key + " needs a value");
        val = argv[++i];
      }
      // no option takes "" (an empty --out= passed the checks, trained, then failed to rename)
      if (val.empty()) throw std::invalid_argument("option --" + key + " has an empty value");
      a.kv[key] = val;
    } else {
      throw std::invalid_argument("unknown option --" + key + " (--help lists the options)");
    }
  }
  return a;
}

}  // namespace fp8rl::cli
