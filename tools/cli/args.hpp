// tools/cli/args.hpp -- a small strict argument parser for the fp8rl subcommands that run
// without the actor system (score, generate, sft, eval). Unknown flags are errors.
#pragma once
#include <cfloat>
#include <climits>
#include <optional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8rl::cli {

struct args {
  std::map<std::string, std::string> kv;  // --key value or --key=value
  std::set<std::string> flags;            // --switch
  bool has(const std::string& k) const { return kv.count(k) > 0; }
  std::string get(const std::string& k, const std::string& def = "") const {
    auto it = kv.find(k);
    return it == kv.end() ? def : it->second;
  }
  std::string need(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw std::invalid_argument("missing required option --" + k);
    return it->second;
  }
  // Integer / finite number values within [lo, hi]; anything else is an error naming the option.
  long long get_int(const std::string& k, long long def, long long lo = LLONG_MIN, long long hi = LLONG_MAX) const;
  double get_num(const std::string& k, double def, double lo = -DBL_MAX, double hi = DBL_MAX) const;
};

// The integer that all of `t` spells (no trailing text, within long long), else nullopt.
std::optional<long long> int_of(const std::string& t);

// Thrown by args_parse once it has printed the command's usage for --help or -h (exit code 0).
struct help_shown {};

// valued: options that take a value; switches: options without one; usage: the command's help
// text, which names every option (checked on each call: an option missing there is a logic_error).
args args_parse(int argc, char** argv, int first, const std::set<std::string>& valued,
                const std::set<std::string>& switches, const char* usage);

}  // namespace fp8rl::cli
