// models/checkpoint.hpp -- training checkpoints: model (HF layout) + optimizer state + run state.
// defines: checkpoint, checkpoint_save, checkpoint_load, checkpoint_weight_version,
//          checkpoint_save_check, checkpoint_dir_replace, fsync_path, file_replace_durably
//
// Layout of a checkpoint directory:
//   config.json, model.safetensors   the model, loadable by any HF-compatible tool
//   optimizer.safetensors            AdamW moments as "m.<name>", "v.<name>" (F32)
//   state.json                       {"adam_step"} and the caller's run state: "weight_version",
//                                    "prompt_cursor", "run", "train_set" {"examples", "fingerprint"}
//                                    (fp8rl train); "phase", "task" (sft)
// Saving writes everything (also the caller's extra files: tokenizer, calibration batch) into
// DIR.tmp, flushes its files to the device, then exchanges it with DIR in one step (renameat2
// RENAME_EXCHANGE) and flushes the parent directory, so DIR always holds a whole checkpoint, the
// previous one until the exchange -- also after a power loss or a kernel crash, not only after the
// process's (the files and the renames sat in the page cache). Where the filesystem cannot
// exchange, DIR moves aside to DIR.old for the moment between two renames; a load that finds
// DIR missing and DIR.old there says so.
#pragma once
#include <functional>
#include <string>

#include "models/adamw.hpp"
#include "models/params.hpp"

namespace fp8rl::models {

struct checkpoint {
  model_params params;
  adamw_state opt;
  std::string state_json = "{}";  // caller's run state (step, versions, rng, data cursor)
};

// Throws std::invalid_argument where checkpoint_save(dir) would fail for want of a place: DIR.tmp
// or DIR.old there and not a save's own, or no directory to write in (the nearest one above DIR is
// a file, or not writable: a read-only filesystem). Changes nothing; for callers about to do work
// whose result the save keeps (`fp8rl sft` trained, then failed saving).
void checkpoint_save_check(const std::string& dir);
// extra(tmp) writes the caller's files into the temporary directory before it becomes dir.
void checkpoint_save(const std::string& dir, const checkpoint& c,
                     const std::function<void(const std::string& tmp)>& extra = {});
// what: a training checkpoint (state.json required), or also a model directory (a Hugging Face
// download: config.json + weights + tokenizer, no state.json), which loads as a fresh start
// (adam_step 0, no optimizer moments, state "{}").
enum class checkpoint_kind { training, model_ok };
checkpoint checkpoint_load(const std::string& dir, checkpoint_kind what = checkpoint_kind::training);
// The weight version state.json records (a learner's checkpoint: the steps its weights have had);
// 0 where the directory has no state.json or it has no "weight_version" (an SFT or HF model).
uint64_t checkpoint_weight_version(const std::string& dir);
// The complete directory tmp takes dir's place: by RENAME_EXCHANGE, or -- where the filesystem
// refuses it (EINVAL, ENOSYS), or asked -- by two renames with dir.old between them.
enum class dir_swap { exchange, renames };
void checkpoint_dir_replace(const std::string& tmp, const std::string& dir, dir_swap how = dir_swap::exchange);
// Flushes a file's or directory's data and metadata to the device (fsync); throws
// std::system_error naming the path -- but for a directory on a filesystem that flushes none
// (EINVAL), said once as a warning.
void fsync_path(const std::string& path);
// path's contents become `text` whole or not at all, also across a power loss: written to
// path.tmp, flushed, renamed over path, the directory flushed. A failed write throws naming
// path.tmp and `kept` (what the caller still has: e.g. the previous checkpoint's name).
void file_replace_durably(const std::string& path, const std::string& text, const std::string& kept);

}  // namespace fp8rl::models
