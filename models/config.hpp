// models/config.hpp -- Llama-family model configuration (Hugging Face config.json fields).
// defines: model_config_mismatch, model_config, model_config_load, model_config_parse, model_config_to_json
//
// Legend used across models/: T = tokens in a packed batch, C = hidden size, H = attention
// heads, KV = key/value heads, D = head dim (C / H unless given), F = intermediate size,
// V = vocabulary, L = layers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp8rl::models {

// Llama 3's rope_scaling {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
// "original_max_position_embeddings"} (Llama 3.1/3.2/3.3); factor 0: no scaling.
struct rope_llama3 {
  double factor = 0, low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_position_embeddings = 0;
};

// RoPE's inverse frequencies [D/2] in FP32, as HF computes them: 1 / theta^(2i/D) (the default
// rope), then with Llama 3 scaling (transformers' _compute_llama3_parameters): wavelengths
// 2 pi / f above original / low_freq_factor divided by factor, below original / high_freq_factor
// kept, in between s * f + (1 - s) * f / factor with s = (original / wavelength - low) / (high - low).
std::vector<float> rope_inv_freq(double theta, int64_t D, const rope_llama3& scaling = {});

struct model_config {
  int64_t hidden_size = 0;              // C
  int64_t intermediate_size = 0;        // F
  int64_t num_hidden_layers = 0;        // L
  int64_t num_attention_heads = 0;      // H
  int64_t num_key_value_heads = 0;      // KV (GQA: H % KV == 0)
  int64_t head_dim = 0;                 // D (0 in the file -> C / H)
  int64_t vocab_size = 0;               // V
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  rope_llama3 rope_scaling;             // Llama 3.1's rope_scaling; factor 0: none
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t bos_token_id = -1;
  std::vector<int64_t> eos_token_ids;  // HF's eos_token_id, an id or a list (Llama 3.1 Instruct: three)

  int64_t q_dim() const { return num_attention_heads * head_dim; }     // H*D
  std::vector<float> rope_inv_freq() const;                           // [D/2], see rope_inv_freq below
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }    // KV*D
  void validate() const;  // throws std::invalid_argument naming the field
};

// Where `got` describes another model than `want` (a field of the tensor layout or of the math:
// sizes, heads, vocabulary, tied embeddings, norm eps, RoPE): "FIELD X, expected Y" for the
// first such field; empty when the same model (max positions and token ids may differ).
std::string model_config_mismatch(const model_config& want, const model_config& got);

// Parses config.json text; `source` names the file in errors. Unknown fields and unsupported
// values (rope_scaling, biases, other activations, ...) are errors naming the field.
// The built-in model sizes (random init / SFT warm start for the built-in tasks):
// tiny = hidden 128, 2 layers, 4 heads (2 KV), intermediate 256; small = hidden 512, 8 layers,
// 8 heads (2 KV), intermediate 1536 (the bench-train shape).
// Its tokenizer's bos/eos ids (-1: none) go into the config, so a saved checkpoint's config.json
// names the end of sequence `fp8rl generate` stops on.
model_config model_config_builtin(const std::string& size, int64_t vocab, int64_t max_positions, int64_t bos, int64_t eos);

model_config model_config_parse(const std::string& json_text, const std::string& source);
model_config model_config_load(const std::string& path);
std::string model_config_to_json(const model_config& c);

}  // namespace fp8rl::models
