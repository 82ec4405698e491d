// models/json_io.hpp -- JSON read strictly from user files: a key twice in one object is an error
// naming it (nlohmann keeps the last one silently: a duplicated rope_theta changed the model, a
// second safetensors entry replaced a tensor), and a directory or unreadable file is named; and a
// file written, checked at its close.
// defines: json_parse_strict, json_file_read, file_text_read, jsonl_errors, open_failure, write_close_checked,
//          file_write_checked, errno_of_a_write
#pragma once
#include <nlohmann/json.hpp>
#include <cerrno>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>

namespace fp8rl::models {

// Parses text; throws std::invalid_argument "<where>: not valid JSON: ..." or "<where>: key 'k'
// appears twice in one object" (no "<where>: " when where is empty).
nlohmann::json json_parse_strict(std::string_view text, const std::string& where);
// Reads and parses the file at path (errors name it: "not a file", "cannot open", as above).
nlohmann::json json_file_read(const std::string& path);
// The bytes of the regular file at path (errors as json_file_read's).
std::string file_text_read(const std::string& path);

// Why the file at path could not be opened for reading: "PATH: no such file", "PATH: is a
// directory, not a file", else "PATH: cannot open (<errno's text>)" (call right after the failed
// open). "cannot open" alone said neither what nor why.
std::string open_failure(const std::string& path);

// Closes f (opened on path) and throws std::runtime_error "PATH: write failed[: <errno's text>][
// (kept)]" when a write failed, the last buffered one's included: checked before the close, a disk
// that filled at the final flush went unseen, and the cut file was renamed into place as whole;
// "PATH: cannot open for writing: <why>[ (kept)]" where f never opened (call it right after the writes).
void write_close_checked(std::ofstream& f, const std::string& path, const std::string& kept = "");
// `text` as the whole file at path (created or truncated), through write_close_checked.
void file_write_checked(const std::string& path, std::string_view text, const std::string& kept = "");
// Whether errno value e is one a failed write sets: errno read after the failure (a later call may
// have changed it) is that write's where it is one of these.
inline bool errno_of_a_write(int e) { return e == ENOSPC || e == EFBIG || e == EDQUOT || e == EIO || e == EPIPE; }

// A JSONL reader's bad lines, so that one error names them all (the first 20).
class jsonl_errors {
 public:
  explicit jsonl_errors(std::string path) : path_(std::move(path)) {}
  void add(const std::string& message);  // "FILE:LINE: why"
  // Throws std::invalid_argument "FILE: N malformed line(s)[ (the first 20)]:\n  FILE:LINE: ..."
  // when any came (`one_plain`: a single one as its own message).
  void throw_if_any(bool one_plain = false) const;

 private:
  std::string path_, text_;
  int64_t count_ = 0;
};

}  // namespace fp8rl::models
