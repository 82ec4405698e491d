// actors/env.cpp -- per-process actor environment.
#include "actors/env.hpp"

#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "models/cpu/cpu_backend.hpp"
#include "models/params.hpp"
#include "models/rl/rl.hpp"
#include "quant/cpu_isa.hpp"
#include "quant/gemm.hpp"

namespace fp8rl::actors {

std::shared_ptr<const actor_env> env_make(const run_config& cfg, const std::string& node, const std::string& run_dir,
                                          const std::string& init_dir, run_start start, const std::string& run_id) {
  auto e = std::make_shared<actor_env>();
  e->cfg = cfg;
  e->rl = recipe_rl_config(cfg);
  e->node = node;
  e->run_dir = run_dir;
  e->init_dir = init_dir;
  e->ref_dir = cfg.init == "tiny" ? (std::filesystem::path(run_dir) / "checkpoints" / "init").string() : cfg.init;
  e->start_version = start.version;
  e->start_cursor = start.prompt_cursor;
  e->run_id = run_id;
  e->model = models::model_config_load((std::filesystem::path(init_dir) / "config.json").string());
  e->tok_file = models::tokenizer_file_read(init_dir);  // read once: the bytes the run uses are the ones it saves
  e->tok = models::tokenizer_make(e->tok_file);
  e->stops = models::stop_ids(e->model, *e->tok);
  return e;
}

caf::error actor_exception_error(const std::string& who, std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return caf::make_error(caf::sec::runtime_error, who + ": " + x.what());
  } catch (...) {
    return caf::make_error(caf::sec::runtime_error, who + ": an exception that is not a std::exception");
  }
}

std::string node_tiles_problem(const run_config& cfg, const node_spec& n, bool warm_start) {
  if (quant::gemm_tiles_available()) return "";
  const bool trains = !n.learners.empty() || n.has("calibration") || warm_start;
  const auto rl = recipe_rl_config(cfg);
  const struct { const char* key; const std::string& value; bool asked; } policies[] = {
      {"precision.generation", cfg.generation, rl.gen_policy.tiles && (trains || !n.rollouts.empty())},
      {"precision.training", cfg.training, rl.train_policy.tiles && trains}};
  for (const auto& p : policies)
    if (p.asked)
      return std::string(p.key) + " = " + p.value + " asks for tile GEMMs and this CPU has no AMX-BF16 (active ISA: " +
             std::string(quant::cpu_isa_name(quant::cpu_isa_active())) + ")";
  return "";
}

std::string device_problem(const device_spec& d) {
  if (d.kind == "cpu") return "";
  return "device '" + d.str() + "': this build has no CUDA backend for actors (gpu/ is kernel-level only)";
}

std::string device_capacity_problem(const device_spec& d, int cpus) {
  if (d.kind != "cpu" || d.index <= cpus) return "";
  return "device '" + d.str() + "' asks for " + std::to_string(d.index) + " threads and this machine runs " + std::to_string(cpus) +
         " (the CPUs oneTBB may use here): give it cpu:" + std::to_string(cpus) + " or fewer";
}

std::unique_ptr<tbb::task_arena> arena_for(const device_spec& d) {
  return std::make_unique<tbb::task_arena>(d.index > 0 ? static_cast<int>(d.index) : tbb::task_arena::automatic);
}

std::unique_ptr<models::backend> backend_for(const device_spec& d) {
  if (const std::string why = device_problem(d); !why.empty()) throw std::invalid_argument(why);
  return models::make_cpu_backend();
}

std::optional<uint64_t> fault_env_number(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  uint64_t n = 0;
  const char* end = v + std::strlen(v);
  if (const auto [ptr, ec] = std::from_chars(v, end, n); ec != std::errc{} || ptr != end)  // no sign, space or overflow
    throw std::invalid_argument(std::string(name) + "='" + v + "': not a whole number");
  return n;
}

}  // namespace fp8rl::actors
