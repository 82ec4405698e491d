// models/checkpoint.cpp -- atomic checkpoint directories.
#include "models/checkpoint.hpp"
#include "models/json_io.hpp"
#include "models/log.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <system_error>

namespace fp8rl::models {
namespace fs = std::filesystem;

namespace {
// DIR.tmp and DIR.old are a save's own: the next save removes what a crash left there -- a marked
// directory (a save marks DIR.tmp while writing it, and whatever it is about to delete) or a whole
// checkpoint (config.json) -- never a directory of the same name the user keeps there.
constexpr const char* kUnfinished = ".fp8rl-unfinished-checkpoint";

void mark_ours(const fs::path& p) { file_write_checked((p / kUnfinished).string(), "fp8rl's checkpoint save: safe to delete\n"); }

// Refuses `p` naming it unless absent or ours (what a save would delete).
void refuse_unless_ours(const fs::path& p, const char* outcome) {
  if (fs::exists(p) && !fs::exists(p / kUnfinished) && !fs::exists(p / "config.json"))
    throw std::invalid_argument(p.string() + ": exists and is not a checkpoint save's own (move it away; " + outcome + ")");
}

// Removes `p` if absent or ours, else refuses naming it.
void remove_if_ours(const fs::path& p) {
  refuse_unless_ours(p, "the checkpoint was not saved");
  if (fs::exists(p)) fs::remove_all(p);
}

// "DIR/" is DIR: its DIR.tmp and DIR.old were DIR/.tmp and DIR/.old, inside it (`sft --out ck/`
// trained, then failed renaming ck into itself).
std::string without_trailing_slash(std::string d) {
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d;
}

// Deletes a directory of ours, marked first: cut short, the next save still knows it as ours.
void remove_ours(const fs::path& p) {
  mark_ours(p);
  fs::remove_all(p);
}
}  // namespace

// Deleting dir and then renaming lost both checkpoints to a crash in between (dir gone, nothing
// ever recovered dir.tmp): the exchange, or two renames with dir.old between them.
void checkpoint_dir_replace(const std::string& tmp_in, const std::string& dir_in, dir_swap how) {
  const std::string tmp = without_trailing_slash(tmp_in), dir = without_trailing_slash(dir_in);
  if (!fs::exists(dir)) return fs::rename(tmp, dir);
  if (how == dir_swap::exchange) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
      remove_ours(tmp);  // the previous checkpoint, now at tmp
      return;
    }
    if (errno != EINVAL && errno != ENOSYS)
      throw std::system_error(errno, std::generic_category(), "checkpoint: exchanging " + tmp + " with " + dir);
  }
  const fs::path old = dir + ".old";
  remove_if_ours(old);  // a previous checkpoint a save cut after its second rename left
  fs::rename(dir, old);
  fs::rename(tmp, dir);
  remove_ours(old);
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "fsync: opening " + path);
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc == 0) return;
  if (err == EINVAL && fs::is_directory(path)) {  // some network and FUSE filesystems flush no directory
    static std::once_flag said;
    std::call_once(said, [&] { log_get("checkpoint")->warn("{}: this filesystem cannot flush a directory (fsync: EINVAL); a power loss "
                                                           "may lose the newest rename", path); });
    return;
  }
  throw std::system_error(err, std::generic_category(), "fsync: " + path);
}

void file_replace_durably(const std::string& path, const std::string& text, const std::string& kept) {
  const std::string tmp = path + ".tmp";
  file_write_checked(tmp, text, kept);
  fsync_path(tmp);
  fs::rename(tmp, path);
  fsync_path(fs::absolute(path).parent_path().string());
}

void checkpoint_save_check(const std::string& dir_in) {
  const std::string dir = without_trailing_slash(dir_in);
  for (const char* aside : {".tmp", ".old"}) refuse_unless_ours(dir + aside, "nothing was done");
  fs::path up = fs::absolute(dir).parent_path();  // where DIR.tmp goes, or the nearest directory above it
  while (!fs::exists(up) && up != up.root_path()) up = up.parent_path();
  if (!fs::is_directory(up)) throw std::invalid_argument(dir + ": " + up.string() + " is not a directory (nothing can be saved under it)");
  if (::access(up.c_str(), W_OK) != 0)
    throw std::invalid_argument(dir + ": cannot write in " + up.string() + " (" + std::strerror(errno) + ")");
}

void checkpoint_save(const std::string& dir_in, const checkpoint& c, const std::function<void(const std::string&)>& extra) {
  const std::string dir = without_trailing_slash(dir_in);
  const fs::path tmp = dir + ".tmp", parent = fs::absolute(dir).parent_path();
  const bool new_parent = !fs::exists(parent);  // (its own entry is flushed too: RUN_DIR/checkpoints)
  remove_if_ours(tmp);
  fs::create_directories(tmp);
  mark_ours(tmp);
  model_save(tmp.string(), c.params);
  if (!c.opt.m.empty()) {
    st_tensors t;
    for (const auto& info : c.params.layout.infos) {
      st_tensor m, v;
      m.shape = v.shape = info.shape;
      m.data.assign(c.opt.m.begin() + info.offset, c.opt.m.begin() + info.offset + info.numel);
      v.data.assign(c.opt.v.begin() + info.offset, c.opt.v.begin() + info.offset + info.numel);
      t.emplace("m." + info.name, std::move(m));
      t.emplace("v." + info.name, std::move(v));
    }
    safetensors_write((tmp / "optimizer.safetensors").string(), t);
  }
  nlohmann::json s = nlohmann::json::parse(c.state_json);
  s["adam_step"] = c.opt.step;
  file_write_checked((tmp / "state.json").string(), s.dump(2) + "\n", "the previous " + dir + " is kept");
  if (extra) extra(tmp.string());
  fs::remove(tmp / kUnfinished);
  for (const auto& e : fs::directory_iterator(tmp)) if (e.is_regular_file()) fsync_path(e.path().string());  // (flat: no subdirectories)
  fsync_path(tmp.string());
  checkpoint_dir_replace(tmp.string(), dir);
  fsync_path(parent.string());  // the exchange itself
  if (new_parent) fsync_path(parent.parent_path().string());
}

uint64_t checkpoint_weight_version(const std::string& dir) {
  const fs::path st = fs::path(dir) / "state.json";
  if (!fs::exists(st)) return 0;
  const nlohmann::json s = json_file_read(st.string());
  if (!s.is_object()) throw std::invalid_argument(st.string() + ": not a JSON object");
  if (!s.contains("weight_version")) return 0;
  if (!s["weight_version"].is_number_unsigned())
    throw std::invalid_argument(st.string() + ": key 'weight_version' is not an integer >= 0");
  return s["weight_version"].get<uint64_t>();
}

checkpoint checkpoint_load(const std::string& dir, checkpoint_kind what) {
  checkpoint c;
  c.params = model_load(dir);
  const fs::path st = fs::path(dir) / "state.json";
  const fs::path op = fs::path(dir) / "optimizer.safetensors";
  if (!fs::exists(st) && what == checkpoint_kind::model_ok && !fs::exists(op)) return c;  // a model: a fresh start
  if (!fs::exists(st))
    throw std::invalid_argument(st.string() + ": missing (not a training checkpoint" +
                                (fs::exists(op) ? std::string(", yet optimizer.safetensors is there)") : std::string(")")));
  const nlohmann::json s = json_file_read(st.string());
  if (!s.is_object()) throw std::invalid_argument(st.string() + ": not a JSON object");
  if (!s.contains("adam_step") || !s["adam_step"].is_number_unsigned())
    throw std::invalid_argument(st.string() + ": key 'adam_step' missing or not an integer >= 0");
  // 2^64 - 1 read as int64 was -1: AdamW's first bias correction 1 - beta^0 = 0 made every weight NaN
  if (s["adam_step"].get<uint64_t>() >= (uint64_t{1} << 62))
    throw std::invalid_argument(st.string() + ": key 'adam_step' = " + s["adam_step"].dump() + " is not a step count (>= 2^62)");
  c.opt.step = s["adam_step"].get<int64_t>();
  c.state_json = s.dump();
  if (fs::exists(op)) {
    auto t = safetensors_read(op.string());
    c.opt.m.assign(static_cast<size_t>(c.params.layout.total), 0.0f);
    c.opt.v.assign(static_cast<size_t>(c.params.layout.total), 0.0f);
    auto dims = [](const std::vector<int64_t>& shape) {
      std::string r = "[";
      for (size_t i = 0; i < shape.size(); ++i) r += (i ? ", " : "") + std::to_string(shape[i]);
      return r + "]";
    };
    for (const auto& info : c.params.layout.infos) {
      for (const char* k : {"m.", "v."}) {
        auto it = t.find(k + info.name);
        if (it == t.end()) throw std::invalid_argument(op.string() + ": tensor '" + std::string(k) + info.name + "' missing");
        if (it->second.shape != info.shape)  // the element count alone let a transposed moment through
          throw std::invalid_argument(op.string() + ": tensor '" + std::string(k) + info.name + "' has shape " +
                                      dims(it->second.shape) + ", the model's is " + dims(info.shape));
        const auto& d = it->second.data;  // the next update would spread a NaN moment to the weights
        const auto bad = std::find_if(d.begin(), d.end(), [&](float x) { return !std::isfinite(x) || (k[0] == 'v' && x < 0); });
        if (bad != d.end())
          throw std::invalid_argument(op.string() + ": tensor '" + std::string(k) + info.name + "' holds " + std::to_string(*bad) +
                                      " at index " + std::to_string(bad - d.begin()) + (k[0] == 'v' ? " (finite, >= 0 expected)" : " (finite expected)"));
        auto& dst = k[0] == 'm' ? c.opt.m : c.opt.v;
        std::copy(d.begin(), d.end(), dst.begin() + info.offset);
        t.erase(it);
      }
    }
    if (!t.empty())  // moments of another model's tensors: ignored, they said the file fit this one
      throw std::invalid_argument(op.string() + ": tensor '" + t.begin()->first + "' is no moment of this model's parameters");
  } else if (c.opt.step > 0) {
    throw std::invalid_argument(op.string() + ": missing, but state.json says adam_step = " + std::to_string(c.opt.step));
  }
  return c;
}

}  // namespace fp8rl::models
