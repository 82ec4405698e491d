// models/safetensors.hpp -- safetensors I/O (single file and sharded with an index json).
// defines: st_tensor, st_dtype, safetensors_read, safetensors_write, safetensors_load_dir,
//          safetensors_parse
//
// Tensors are read into FP32 (F32, BF16 and F16 are accepted; BF16/F16 widen exactly).
// Every malformed input -- short file, bad header length, invalid JSON, unknown dtype, shape
// and byte-range disagreements, overlapping or out-of-range data -- throws st_error naming the
// file and, where known, the tensor. The parser is fuzzed (tests/models/io_test.cpp).
#pragma once
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8rl::models {

enum class st_dtype : uint8_t { f32, bf16, f16 };

struct st_error : std::invalid_argument {  // bad input: `fp8rl` exits 2 on it, as on every other
  using std::invalid_argument::invalid_argument;
};

struct st_tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;  // FP32 values
  int64_t numel() const;
};

using st_tensors = std::map<std::string, st_tensor>;

// Parses an in-memory safetensors image; `source` names it in errors.
st_tensors safetensors_parse(const std::vector<uint8_t>& bytes, const std::string& source);
st_tensors safetensors_read(const std::string& path);
// Writes tensors as `dtype` (F32 exact; BF16 and F16 round to nearest even, a value beyond
// F16's range is an error naming the tensor); metadata goes to "__metadata__". Writes to
// path.tmp then renames, so a crash never leaves half a file.
void safetensors_write(const std::string& path, const st_tensors& tensors, st_dtype dtype = st_dtype::f32,
                       const std::map<std::string, std::string>& metadata = {});
// A model directory: model.safetensors, or model.safetensors.index.json + its shards.
// file_of (optional) receives each tensor's file, for errors about it.
st_tensors safetensors_load_dir(const std::string& dir, std::map<std::string, std::string>* file_of = nullptr);

}  // namespace fp8rl::models
