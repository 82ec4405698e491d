// actors/train.hpp -- `fp8rl train`: one binary for every node of a run.
// defines: train_main
//
//   fp8rl train [--recipe FILE] [--topology FILE] [--node NAME] [--node-wait S] [--run-dir DIR] [--resume|--overwrite]
//               [--dump-config] [--section.key=value ...] [CAF options: --scheduler.*, ...]
// With no arguments: the embedded default recipe, one process, every actor local, CPU, the
// built-in task and a tiny model with its own SFT warm start. The controller node prepares the
// run directory and the initial checkpoint, spawns its local actors, connects to every other
// node of the topology (each started as `fp8rl train --topology F --node NAME`, e.g. by caf-run)
// and has that node's agent spawn the rest; then the controller drives the run.
#pragma once

namespace fp8rl::actors {

int train_main(int argc, char** argv);  // argv[0] is "train"

}  // namespace fp8rl::actors
