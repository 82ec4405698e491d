// tests/test_util.hpp -- seeded random data and small helpers shared by the test suites.
#pragma once
#include <csignal>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <sstream>
#include <random>
#include <stdexcept>
#include <string>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "quant/cpu_isa.hpp"

namespace fp8rl::test {

// Sets or clears a file's or directory's immutable flag (FS_IMMUTABLE_FL: not even root removes it
// or writes in it); false where the file system or the process's capabilities do not allow it.
inline bool immutable_set(const std::filesystem::path& f, bool on) {
  const int fd = ::open(f.c_str(), O_RDONLY);
  if (fd < 0) return false;
  int flags = 0;
  bool ok = ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
  flags = on ? flags | FS_IMMUTABLE_FL : flags & ~FS_IMMUTABLE_FL;
  ok = ok && ::ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
  ::close(fd);
  return ok;
}

// Limits the ISA the kernels dispatch to for a scope; the limit is lifted again however the scope
// ends (a failed ASSERT returns early: the rest of the binary must not stay on the limited path).
class isa_limit_scope {
 public:
  explicit isa_limit_scope(quant::cpu_isa max) { quant::cpu_isa_set_limit(max); }
  ~isa_limit_scope() { quant::cpu_isa_set_limit(quant::cpu_isa::amx); }  // amx: no limit
  isa_limit_scope(const isa_limit_scope&) = delete;
  isa_limit_scope& operator=(const isa_limit_scope&) = delete;
};

// For a scope: this process's soft limit on `resource` at `cur` (the hard limit kept), and SIGXFSZ
// ignored (a write past RLIMIT_FSIZE fails with EFBIG rather than killing the process); both
// restored however the scope ends. A full disk or a small memory, in this process, for one call.
class rlimit_scope {
 public:
  rlimit_scope(int resource, rlim_t cur) : resource_(resource) {
    if (::getrlimit(resource, &old_) != 0) throw std::runtime_error("getrlimit failed");
    rlimit l = old_;
    l.rlim_cur = cur;
    old_xfsz_ = std::signal(SIGXFSZ, SIG_IGN);
    if (::setrlimit(resource, &l) != 0) throw std::runtime_error("setrlimit failed");
  }
  ~rlimit_scope() {
    ::setrlimit(resource_, &old_);
    std::signal(SIGXFSZ, old_xfsz_);
  }
  rlimit_scope(const rlimit_scope&) = delete;
  rlimit_scope& operator=(const rlimit_scope&) = delete;

 private:
  int resource_;
  rlimit old_{};
  void (*old_xfsz_)(int) = SIG_DFL;
};

// Normal(0, sigma) values with a few outliers (x outlier_mul) so blocks have varied amax.
inline std::vector<float> randn(size_t n, uint64_t seed, float sigma = 1.0f,
                                float outlier_frac = 0.01f, float outlier_mul = 30.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g) * (u(g) < outlier_frac ? outlier_mul : 1.0f);
  return v;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Index of the first element whose bits differ, or -1.
inline int64_t first_diff(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4)) return static_cast<int64_t>(i);
  return a.size() == b.size() ? -1 : static_cast<int64_t>(std::min(a.size(), b.size()));
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// A shell command's exit code (128 when it did not exit normally: a crash) and its stdout +
// stderr, for tests that run the project's binaries.
struct command_result {
  int rc;
  std::string out;
};
inline command_result run_command(const std::string& cmd) {
  const auto log = std::filesystem::temp_directory_path() / ("fp8rl_cmd_" + std::to_string(::getpid()) + ".txt");
  const int rc = std::system((cmd + " > " + log.string() + " 2>&1").c_str());
  std::ifstream f(log);
  std::stringstream ss;
  ss << f.rdbuf();
  std::filesystem::remove(log);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : 128, ss.str()};
}

// The message of the E that `fn` throws ("" if it throws none).
template <class E, class Fn>
std::string thrown_text(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}
// The message of the std::exception that `fn` throws ("" if it throws none).
inline std::string error_of(const std::function<void()>& fn) { return thrown_text<std::exception>(fn); }

}  // namespace fp8rl::test
