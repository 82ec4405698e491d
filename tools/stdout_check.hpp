// tools/stdout_check.hpp -- whether what a program printed got out: its lines are its result (a
// full disk or a closed pipe cut them, and the programs exited 0).
// defines: stdout_failure, stdout_failure_why, stdout_checked
#pragma once
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "models/json_io.hpp"

namespace fp8rl::tools {

// 0 where standard output flushed and holds no error; else the flush's errno, or a write's that
// failed before it (errno at the call, where it is a write's error: call right after the writes),
// or -1 (unknown).
inline int stdout_failure() {
  const int before = errno;
  errno = 0;
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout)) return 0;
  if (!flushed && err) return err;
  return fp8rl::models::errno_of_a_write(before) ? before : -1;
}

// ": <errno's text>" for stdout_failure()'s value (nothing where it is unknown)
inline std::string stdout_failure_why(int err) { return err > 0 ? std::string(": ") + std::strerror(err) : std::string(); }

// A program's exit code: rc, or (rc 0) 1 with "WHO: error: writing standard output failed[: why]"
// on stderr where standard output did not get out.
inline int stdout_checked(const std::string& who, int rc) {
  const int err = stdout_failure();
  if (err == 0) return rc;
  std::fprintf(stderr, "%s: error: writing standard output failed%s\n", who.c_str(), stdout_failure_why(err).c_str());
  return rc == 0 ? 1 : rc;
}

}  // namespace fp8rl::tools
