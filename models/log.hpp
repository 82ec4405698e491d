// models/log.hpp -- named per-component spdlog loggers ("model", "rollout", "learner", ...).
// defines: log_get, log_set_level
// The level comes from config/CLI (`fp8rl train`: `[run] log_level` or `--run.log_level=debug`;
// the other subcommands: `--log-level debug`); it applies to every logger, made before or after.
// Each writes to stderr with the component name, so interleaved actor output stays attributable.
#pragma once
#include <spdlog/spdlog.h>

#include <memory>
#include <string>

namespace fp8rl {

std::shared_ptr<spdlog::logger> log_get(const std::string& component);
// "trace", "debug", "info", "warn", "error", "off"; throws std::invalid_argument otherwise.
void log_set_level(const std::string& level);

}  // namespace fp8rl
