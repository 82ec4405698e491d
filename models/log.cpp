// models/log.cpp -- component loggers on one shared stderr sink.
#include "models/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <mutex>
#include <stdexcept>

namespace fp8rl {
namespace {
std::mutex g_mu;
spdlog::level::level_enum g_level = spdlog::level::info;
}  // namespace

std::shared_ptr<spdlog::logger> log_get(const std::string& component) {
  std::lock_guard<std::mutex> g(g_mu);
  if (auto l = spdlog::get(component)) return l;
  auto l = spdlog::stderr_color_mt(component);
  l->set_pattern("[%H:%M:%S.%e] [%n] [%^%l%$] %v");
  l->set_level(g_level);
  return l;
}

void log_set_level(const std::string& level) {
  auto lv = spdlog::level::from_str(level);
  if (lv == spdlog::level::off && level != "off")
    throw std::invalid_argument("log level '" + level + "' is not one of trace, debug, info, warn, error, off");
  std::lock_guard<std::mutex> g(g_mu);
  g_level = lv;
  spdlog::set_level(lv);
}

}  // namespace fp8rl
