// models/json_io.cpp -- strict JSON parsing (duplicate keys refused), file reading, checked writes.
#include "models/json_io.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <iterator>
#include <stdexcept>
#include <vector>

namespace fp8rl::models {

nlohmann::json json_parse_strict(std::string_view text, const std::string& where) {
  const std::string at = where.empty() ? "" : where + ": ";
  std::vector<std::set<std::string>> keys;  // one set per object being parsed
  std::string twice;
  auto note = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json& v) {
    using ev_t = nlohmann::json::parse_event_t;
    if (ev == ev_t::object_start) keys.emplace_back();
    else if (ev == ev_t::object_end) keys.pop_back();
    else if (ev == ev_t::key && !keys.back().insert(v.get<std::string>()).second && twice.empty()) twice = v.get<std::string>();
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end(), note);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(at + "not valid JSON: " + e.what());
  }
  if (!twice.empty()) throw std::invalid_argument(at + "key '" + twice + "' appears twice in one object");
  return j;
}

void write_close_checked(std::ofstream& f, const std::string& path, const std::string& kept) {
  const std::string and_kept = kept.empty() ? std::string() : " (" + kept + ")";
  if (!f.is_open())  // (writing to a stream never opened makes no call: errno is still the open's)
    throw std::runtime_error(path + ": cannot open for writing" + (errno ? std::string(": ") + std::strerror(errno) : std::string()) +
                             and_kept);
  // a write that failed before the close set errno then: kept where it is a write's error (a later
  // call may have changed it; these codes come from writes), else the close's own
  const int earlier = !f ? errno : 0;
  errno = 0;
  f.close();
  if (f) return;
  int err = errno;
  if (!err && errno_of_a_write(earlier)) err = earlier;
  throw std::runtime_error(path + ": write failed" + (err ? std::string(": ") + std::strerror(err) : std::string()) + and_kept);
}

void file_write_checked(const std::string& path, std::string_view text, const std::string& kept) {
  std::ofstream f(path, std::ios::binary);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  write_close_checked(f, path, kept);
}

std::string open_failure(const std::string& path) {
  const int err = errno;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))  // stat failing (a parent without search permission) is not "no such file"
    return path + (ec ? ": cannot open (" + ec.message() + ")" : std::string(": no such file"));
  if (std::filesystem::is_directory(path, ec)) return path + ": is a directory, not a file";
  return path + ": cannot open (" + std::strerror(err) + ")";
}

std::string file_text_read(const std::string& path) {
  if (!std::filesystem::is_regular_file(path))
    throw std::invalid_argument(path + (std::filesystem::exists(path) ? ": not a file" : ": missing"));
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument(open_failure(path));
  std::string text((std::istreambuf_iterator<char>(f)), {});
  if (f.bad()) throw std::invalid_argument(path + ": cannot read");
  return text;
}

nlohmann::json json_file_read(const std::string& path) { return json_parse_strict(file_text_read(path), path); }

void jsonl_errors::add(const std::string& message) {
  if (++count_ <= 20) text_ += "\n  " + message;
}

void jsonl_errors::throw_if_any(bool one_plain) const {
  if (count_ == 1 && one_plain) throw std::invalid_argument(text_.substr(3));
  if (count_)
    throw std::invalid_argument(path_ + ": " + std::to_string(count_) + " malformed line(s)" + (count_ > 20 ? " (the first 20)" : "") +
                                ":" + text_);
}

}  // namespace fp8rl::models
