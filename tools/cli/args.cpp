// tools/cli/args.cpp -- strict option parsing.
#include "tools/cli/args.hpp"

namespace fp8rl::cli {

long long args::get_int(const std::string& k, long long def) const {
  if (!has(k)) return def;
  try {
    size_t pos = 0;
    long long v = std::stoll(kv.at(k), &pos);
    if (pos != kv.at(k).size()) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw std::invalid_argument("option --" + k + ": '" + kv.at(k) + "' is not an integer");
  }
}

double args::get_num(const std::string& k, double def) const {
  if (!has(k)) return def;
  try {
    size_t pos = 0;
    double v = std::stod(kv.at(k), &pos);
    if (pos != kv.at(k).size()) throw std::invalid_argument("");
    return v;
  } catch (const std::exception&) {
    throw std::invalid_argument("option --" + k + ": '" + kv.at(k) + "' is not a number");
  }
}

args args_parse(int argc, char** argv, int first, const std::set<std::string>& valued,
                const std::set<std::string>& switches) {
  args a;
  for (int i = first; i < argc; ++i) {
    std::string s = argv[i];
    if (s.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument '" + s + "'");
    std::string key = s.substr(2), val;
    const auto eq = key.find('=');
    const bool inline_val = eq != std::string::npos;
    if (inline_val) {
      val = key.substr(eq + 1);
      key = key.substr(0, eq);
    }
    if (switches.count(key)) {
      if (inline_val) throw std::invalid_argument("option --" + key + " takes no value");
      a.flags.insert(key);
    } else if (valued.count(key)) {
      if (!inline_val) {
        if (i + 1 >= argc) throw std::invalid_argument("option --" + key + " needs a value");
        val = argv[++i];
      }
      a.kv[key] = val;
    } else {
      throw std::invalid_argument("unknown option --" + key);
    }
  }
  return a;
}

}  // namespace fp8rl::cli
