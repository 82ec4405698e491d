// tools/fp8rl_main.cpp -- the `fp8rl` program: one binary for every role and subcommand.
//   fp8rl train ...      the RL run (actors/train.cpp)
//   fp8rl score ...      per-token logprobs of sequences (tools/cli/cmd_score.cpp)
//   fp8rl generate ...   sampling with the rollout engine (tools/cli/cmd_generate.cpp)
//   fp8rl sft | eval ... warm start / validation accuracy (tools/cli/cmd_sft.cpp)
// `fp8rl CMD --help` prints a command's options. Errors go to stderr as "fp8rl CMD: <what>"
// with exit code 2 (bad input) or "fp8rl CMD: error: <what>" with exit code 1 (failure), standard
// output that could not be written included (tools/stdout_check.hpp).
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

#include "actors/signals.hpp"
#include "actors/train.hpp"
#include "tools/cli/args.hpp"
#include "tools/cli/commands.hpp"
#include "tools/stdout_check.hpp"

namespace {
void usage(std::FILE* to) {
  std::fprintf(to,
               "usage: fp8rl <command> [options]\n"
               "  train     asynchronous FP8 GRPO (actors); no arguments: the embedded default\n"
               "  score     per-token logprobs of sequences under a precision policy\n"
               "  generate  batched sampling with the rollout engine (logprobs, version tags)\n"
               "  sft       supervised warm start on a task; writes a checkpoint\n"
               "  eval      validation accuracy (greedy and sampled pass@1) of a checkpoint\n"
               "fp8rl <command> --help lists a command's options.\n");
}

int run(int argc, char** argv, const std::string& cmd) {
  try {
    // `fp8rl --dump-config [options]` = `fp8rl train --dump-config [options]`: every option counts
    if (cmd == "--dump-config") return fp8rl::actors::train_main(argc, argv);
    if (cmd == "train") return fp8rl::actors::train_main(argc - 1, argv + 1);
    if (cmd == "score") return fp8rl::cli::cmd_score(argc, argv);
    if (cmd == "generate") return fp8rl::cli::cmd_generate(argc, argv);
    if (cmd == "sft") return fp8rl::cli::cmd_sft(argc, argv);
    if (cmd == "eval") return fp8rl::cli::cmd_eval(argc, argv);
    std::fprintf(stderr, "fp8rl: unknown command '%s'\n", cmd.c_str());
    usage(stderr);
    return 2;
  } catch (const fp8rl::cli::help_shown&) {
    return 0;
  } catch (const fp8rl::actors::interrupted& e) {  // a start given up on a signal (actors/signals.hpp)
    std::fprintf(stderr, "fp8rl %s: %s\n", cmd.c_str(), e.what());
    return 128 + e.sig;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "fp8rl %s: %s\n", cmd.c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp8rl %s: error: %s\n", cmd.c_str(), e.what());
    return 1;
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);  // asked for: stdout, as every subcommand's --help
    return fp8rl::tools::stdout_checked(argc < 2 ? "fp8rl" : "fp8rl --help", argc < 2 ? 2 : 0);
  }
  return fp8rl::tools::stdout_checked("fp8rl " + std::string(argv[1]), run(argc, argv, argv[1]));
}
