// models/sampling.hpp -- logit processing shared by the sampler and the learner's logprobs.
// defines: logits_process, sample_processed, logit_processing_problem
//
// z = logits / T (T = temperature; T = 0 -> greedy, logprobs taken at T = 1), then top-k keeps
// tokens whose z is >= the k-th largest (ties at the threshold all stay), then top-p keeps the
// smallest prefix of tokens sorted by probability (descending, ties by lower id) whose mass
// reaches p (the crossing token included). Dropped tokens get z = -inf. The same function runs
// on both sides, so the sampled token's logprob g_t and the learner's p_t share one definition.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "models/backend.hpp"

namespace fp8rl::models {

// z[V] <- processed logits (-inf where dropped); returns log-sum-exp over kept entries:
// m + log(sum of e^(z - m)), m the max, each term models/cpu/fast_exp.hpp's cpu_exp (FP32,
// 2 ulp) summed in double in a fixed lane order.
// work: scratch of at least V entries (indices) when top-k/top-p is on. Throws
// std::invalid_argument, naming the token, where a logit or logit / T is NaN or +inf (or none is
// finite): no distribution to sample from or score under.
double logits_process(const float* logits, int64_t V, const logit_processing& p, float* z,
                      std::vector<int32_t>& work);

// Samples from softmax(z) with uniform u in [0, 1) (inverse CDF, token order): deterministic
// given u. Greedy (temperature 0): argmax of the raw logits, lowest id on ties.
int32_t sample_processed(const float* z, int64_t V, double lse, double u);
int32_t argmax_logits(const float* logits, int64_t V);

// The smallest temperature above 0 (greedy); vLLM's sampling epsilon.
constexpr float kMinTemperature = 1e-5f;
// Why p is not a processing this file defines (temperature 0 or finite in [kMinTemperature, inf),
// top_k >= 0, top_p in (0, 1]); empty when it is.
std::string logit_processing_problem(const logit_processing& p);

}  // namespace fp8rl::models
