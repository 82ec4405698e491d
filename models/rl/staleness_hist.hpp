// models/rl/staleness_hist.hpp -- the staleness histogram's metric keys, "staleness_hist/D"
// (D = learner_version - weight_version of a token: rl.hpp), written with the learner's metrics
// and read back by the controller's progress line and fp8rl-trace summary.
// defines: kStalenessHistPrefix, staleness_hist_bin
#pragma once
#include <charconv>
#include <cstdint>
#include <optional>
#include <string_view>

namespace fp8rl::models {

inline constexpr std::string_view kStalenessHistPrefix = "staleness_hist/";

// D of a "staleness_hist/D" key; nullopt where the key lacks the prefix or D is not an integer >= 0.
inline std::optional<int64_t> staleness_hist_bin(std::string_view key) {
  if (key.substr(0, kStalenessHistPrefix.size()) != kStalenessHistPrefix) return std::nullopt;
  const std::string_view d = key.substr(kStalenessHistPrefix.size());
  int64_t v = -1;
  const auto [end, ec] = std::from_chars(d.data(), d.data() + d.size(), v);
  if (ec != std::errc{} || end != d.data() + d.size() || v < 0) return std::nullopt;
  return v;
}

}  // namespace fp8rl::models
