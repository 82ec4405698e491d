// tools/cli/commands.hpp -- the fp8rl subcommands (each returns the process exit code).
#pragma once

namespace fp8rl::cli {
int cmd_score(int argc, char** argv);     // tools/cli/cmd_score.cpp
int cmd_generate(int argc, char** argv);  // tools/cli/cmd_generate.cpp
int cmd_sft(int argc, char** argv);       // tools/cli/cmd_sft.cpp
int cmd_eval(int argc, char** argv);      // tools/cli/cmd_sft.cpp
}  // namespace fp8rl::cli
