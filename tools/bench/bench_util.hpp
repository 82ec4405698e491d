// tools/bench/bench_util.hpp -- shared harness of the bench-* programs: median timing over
// repetitions, thread-count control (oneTBB arena), and one JSON object per line with --json.
#pragma once
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tools/stdout_check.hpp"

namespace fp8rl::bench {

struct bench_args {
  bool json = false;
  bool quick = false;     // fewer shapes/repetitions (smoke runs)
  int reps = 7;           // repetitions; the median is reported
  std::vector<int> threads = {1, 2};
  std::string only;       // run only impls containing this substring
  std::map<std::string, std::string> extra;  // --key=value options of the program
};

// The positive integer `text` of option `opt`, at most `hi`; anything else ("", "5x", "0", "-2", a
// number past hi) ends the program with status 2 and a message naming the option.
inline int64_t bench_positive(const std::string& opt, const std::string& text, int64_t hi = int64_t{1} << 40) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || v < 1 || v > hi) {
    std::fprintf(stderr, "option %s: '%s' is not an integer in [1, %lld]\n", opt.c_str(), text.c_str(),
                 static_cast<long long>(hi));
    std::exit(2);
  }
  return v;
}

// Which common options a program reads: --threads=LIST where it runs at given thread counts, and
// its most repetitions (each of bench-rl's is a whole training run).
struct bench_common {
  bool threads = true;
  int max_reps = 1 << 20;
};

// Common options, plus the program's own `--key=value` options (`extra_opts`: key -> help line);
// any other option -- also a common one the program does not read -- is an error.
inline bench_args bench_parse(int argc, char** argv, const std::map<std::string, std::string>& extra_opts = {},
                              bench_common common = {}) {
  bench_args a;
  a.reps = std::min(a.reps, common.max_reps);
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--json") a.json = true;
    else if (s == "--quick") { a.quick = true; a.reps = std::min(3, common.max_reps); }
    else if (s.rfind("--reps=", 0) == 0) a.reps = static_cast<int>(bench_positive("--reps", s.substr(7), common.max_reps));
    else if (s.rfind("--only=", 0) == 0) a.only = s.substr(7);
    else if (common.threads && s.rfind("--threads=", 0) == 0) {
      a.threads.clear();
      std::string t = s.substr(10);
      for (size_t p = 0; p <= t.size();) {
        size_t q = t.find(',', p);
        if (q == std::string::npos) q = t.size();
        a.threads.push_back(static_cast<int>(bench_positive("--threads", t.substr(p, q - p), 1 << 12)));
        p = q + 1;
      }
    } else if (s.rfind("--", 0) == 0 && s.find('=') != std::string::npos && extra_opts.count(s.substr(2, s.find('=') - 2))) {
      a.extra[s.substr(2, s.find('=') - 2)] = s.substr(s.find('=') + 1);
    } else if (s == "--help" || s == "-h") {
      std::printf("options: --json --quick --reps=N (default %d, at most %d)%s --only=IMPL (a substring of impl names)\n",
                  std::min(bench_args{}.reps, common.max_reps), common.max_reps, common.threads ? " --threads=1,2" : "");
      for (const auto& [k, help] : extra_opts) std::printf("  --%s=...  %s\n", k.c_str(), help.c_str());
      std::exit(0);
    } else {
      std::fprintf(stderr, "unknown option '%s' (see --help)\n", s.c_str());
      std::exit(2);
    }
  }
  return a;
}

inline bool bench_selected(const bench_args& a, const std::string& impl) {
  return a.only.empty() || impl.find(a.only) != std::string::npos;
}

// The median of v (an even count: the mean of the two middle values); 0 for none.
inline double bench_median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// Median seconds per call of fn over `reps` repetitions; each repetition runs fn enough times to
// last >= min_s (after two untimed calls: a warm-up and the one that sizes the repetitions), so
// short kernels are not timer-bound.
// How many calls of fn last >= min_s (>= 1), from one timed call.
inline int bench_calls_for(const std::function<void()>& fn, double min_s) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  const double one = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return std::max(1, static_cast<int>(min_s / std::max(one, 1e-9)));
}

inline double bench_median(int reps, const std::function<void()>& fn, double min_s = 0.05) {
  using clk = std::chrono::steady_clock;
  fn();
  const int inner = bench_calls_for(fn, min_s);
  std::vector<double> v;
  for (int r = 0; r < reps; ++r) {
    auto a = clk::now();
    for (int i = 0; i < inner; ++i) fn();
    v.push_back(std::chrono::duration<double>(clk::now() - a).count() / inner);
  }
  return bench_median_of(std::move(v));
}

// Seconds per call of n calls of fn.
inline double bench_time_calls(const std::function<void()>& fn, int n) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
}

// Two implementations side by side on a shared machine: max(rounds, 1) rounds, each timing one
// run of a and one of b (each returns its seconds), b first in odd rounds so neither always runs
// second. Per round: a's and b's seconds and the ratio b / a (> 1: a is faster).
struct bench_pair_times {
  std::vector<double> a, b, ratio;
};
inline bench_pair_times bench_side_by_side(int rounds, const std::function<double()>& a, const std::function<double()>& b) {
  bench_pair_times t;
  for (int r = 0; r < std::max(rounds, 1); ++r) {
    if (r % 2 == 0) {
      t.a.push_back(a());
      t.b.push_back(b());
    } else {
      t.b.push_back(b());
      t.a.push_back(a());
    }
    t.ratio.push_back(t.b.back() / t.a.back());
  }
  return t;
}

// One result line. fields: ordered key -> already-formatted JSON value.
using json_fields = std::vector<std::pair<std::string, std::string>>;
inline void bench_emit(const bench_args& a, const json_fields& f) {
  if (a.json) {
    std::string s = "{";
    for (size_t i = 0; i < f.size(); ++i) s += (i ? ", \"" : "\"") + f[i].first + "\": " + f[i].second;
    std::printf("%s}\n", s.c_str());
  } else {
    for (const auto& kv : f) {
      std::string v = kv.second;
      if (!v.empty() && v.front() == '"') v = v.substr(1, v.size() - 2);
      std::printf("%s=%s  ", kv.first.c_str(), v.c_str());
    }
    std::printf("\n");
  }
  if (const int err = fp8rl::tools::stdout_failure()) {  // the results are the program's output: lost, it fails
    std::fprintf(stderr, "bench: writing standard output failed%s\n", fp8rl::tools::stdout_failure_why(err).c_str());
    std::exit(1);
  }
}

inline std::string jstr(const std::string& s) { return "\"" + s + "\""; }
inline std::string jnum(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.6g", v);
  return b;
}

}  // namespace fp8rl::bench
