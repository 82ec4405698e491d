// models/safetensors.cpp -- strict safetensors reader and writer.
#include "models/safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <tuple>
#include <nlohmann/json.hpp>

#include "models/json_io.hpp"
#include "quant/fp8.hpp"

namespace fp8rl::models {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

[[noreturn]] void fail(const std::string& source, const std::string& what) { throw st_error(source + ": " + what); }

float f16_to_float(uint16_t h) {
  const uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
  float v;
  if (e == 0) v = std::ldexp(static_cast<float>(m), -24);
  else if (e == 31) v = m ? NAN : INFINITY;
  else v = std::ldexp(1.0f + static_cast<float>(m) / 1024.0f, static_cast<int>(e) - 15);
  return s ? -v : v;
}

std::vector<uint8_t> read_file(const std::string& path) {
  if (!fs::is_regular_file(path)) throw st_error(path + ": not a file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw st_error(open_failure(path));
  f.seekg(0, std::ios::end);
  const std::streamoff n = f.tellg();
  if (n < 0) throw st_error(path + ": cannot read size");
  f.seekg(0);
  std::vector<uint8_t> b;
  try {  // (a bare std::bad_alloc named nothing)
    b.resize(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    throw st_error(path + ": its " + std::to_string(n) + " bytes do not fit in memory");
  }
  if (n && !f.read(reinterpret_cast<char*>(b.data()), n)) throw st_error(path + ": read failed");
  return b;
}

}  // namespace

int64_t st_tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

st_tensors safetensors_parse(const std::vector<uint8_t>& bytes, const std::string& source) {
  if (bytes.size() < 8) fail(source, "file is " + std::to_string(bytes.size()) + " bytes, shorter than the 8-byte header length");
  uint64_t hlen = 0;
  for (int i = 7; i >= 0; --i) hlen = (hlen << 8) | bytes[static_cast<size_t>(i)];
  if (hlen > bytes.size() - 8) fail(source, "header length " + std::to_string(hlen) + " exceeds the file");
  json h;
  try {
    h = json_parse_strict(std::string_view(reinterpret_cast<const char*>(bytes.data()) + 8, hlen), "header");
  } catch (const std::invalid_argument& e) {
    fail(source, e.what());
  }
  if (!h.is_object()) fail(source, "header is not a JSON object");
  const uint64_t data_size = bytes.size() - 8 - hlen;
  const uint8_t* data = bytes.data() + 8 + hlen;
  st_tensors out;
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> ranges;  // data byte range, tensor
  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {  // str -> str by the format; anything else is not a safetensors header
      if (!it.value().is_object()) fail(source, "__metadata__ is " + it.value().dump() + ", not an object");
      continue;
    }
    const std::string where = "tensor '" + name + "': ";
    const json& t = it.value();
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
      fail(source, where + "entry needs dtype, shape and data_offsets");
    if (!t["dtype"].is_string()) fail(source, where + "dtype is not a string");
    const std::string dt = t["dtype"].get<std::string>();
    size_t esize;
    if (dt == "F32") esize = 4;
    else if (dt == "BF16" || dt == "F16") esize = 2;
    else fail(source, where + "unsupported dtype '" + dt + "' (F32, BF16, F16 are read)");
    st_tensor st;
    if (!t["shape"].is_array()) fail(source, where + "shape is not a list");
    uint64_t numel = 1;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned()) fail(source, where + "shape entries must be non-negative integers");
      const uint64_t v = d.get<uint64_t>();
      if (v > (1ull << 40) || (v && numel > (1ull << 40) / v)) fail(source, where + "shape is too large");
      numel *= v;
      st.shape.push_back(static_cast<int64_t>(v));
    }
    const json& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(source, where + "data_offsets must be two non-negative integers");
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    if (b > e || e > data_size)
      fail(source, where + "data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                       ") outside the " + std::to_string(data_size) + "-byte data section");
    if (e - b != numel * esize)
      fail(source, where + "holds " + std::to_string(e - b) + " bytes, shape and dtype need " +
                       std::to_string(numel * esize));
    ranges.emplace_back(b, e, name);
    try {
      st.data.resize(numel);
    } catch (const std::bad_alloc&) {
      fail(source, where + "its " + std::to_string(numel) + " values as FP32 (" + std::to_string(4 * numel) +
                       " bytes) do not fit in memory");
    }
    const uint8_t* p = data + b;
    for (uint64_t i = 0; i < numel; ++i) {
      if (esize == 4) {
        std::memcpy(&st.data[i], p + 4 * i, 4);
      } else {
        const uint16_t v = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
        st.data[i] = dt == "BF16" ? quant::bf16_to_float(v) : f16_to_float(v);
      }
    }
    out.emplace(name, std::move(st));
  }
  // the tensors tile the data section, as the format's reference implementation requires: bytes
  // no tensor claims are a file appended to, or a tensor its header lost
  std::sort(ranges.begin(), ranges.end());
  uint64_t end = 0;
  std::string prev;
  for (const auto& [b, e, name] : ranges) {
    if (b < end) fail(source, "tensors '" + prev + "' and '" + name + "' overlap in the data section");
    if (b > end)
      fail(source, "bytes [" + std::to_string(end) + ", " + std::to_string(b) + ") of the data section belong to no tensor (" +
                       (prev.empty() ? "before '" + name + "'" : "between '" + prev + "' and '" + name + "'") + ")");
    end = e;
    prev = name;
  }
  if (end != data_size)
    fail(source, std::to_string(data_size - end) + " byte(s) after the last tensor's data (the data section has " +
                     std::to_string(data_size) + ", its tensors end at " + std::to_string(end) +
                     "): a file appended to, or a tensor missing from the header");
  return out;
}

st_tensors safetensors_read(const std::string& path) { return safetensors_parse(read_file(path), path); }

namespace {
// x as IEEE binary16 bits, round to nearest even (the compiler's _Float16 conversion); a finite
// value beyond F16's range is an error naming the tensor, never written as infinity.
uint16_t f16_bits(float x, const std::string& path, const std::string& name) {
  const _Float16 h = static_cast<_Float16>(x);
  if (std::isfinite(x) && !std::isfinite(static_cast<float>(h)))
    throw st_error(path + ": tensor '" + name + "' holds " + std::to_string(x) + ", beyond F16's range (65504)");
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
}  // namespace

void safetensors_write(const std::string& path, const st_tensors& tensors, st_dtype dtype,
                       const std::map<std::string, std::string>& metadata) {
  const size_t esize = dtype == st_dtype::f32 ? 4 : 2;
  const char* dtype_name = dtype == st_dtype::f32 ? "F32" : dtype == st_dtype::bf16 ? "BF16" : "F16";
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& [name, t] : tensors) {
    if (static_cast<int64_t>(t.data.size()) != t.numel())
      throw st_error(path + ": tensor '" + name + "' has " + std::to_string(t.data.size()) + " values for its shape");
    const uint64_t n = t.data.size() * esize;
    h[name] = {{"dtype", dtype_name}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  std::string hs = h.dump();
  while ((8 + hs.size()) % 8) hs.push_back(' ');  // align the data section
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw st_error(tmp + ": cannot create");
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>((uint64_t(hs.size()) >> (8 * i)) & 0xff);
    f.write(reinterpret_cast<const char*>(len), 8);
    f.write(hs.data(), static_cast<std::streamsize>(hs.size()));
    for (const auto& [name, t] : tensors) {
      if (dtype == st_dtype::f32) {
        f.write(reinterpret_cast<const char*>(t.data.data()), static_cast<std::streamsize>(t.data.size() * 4));
      } else {
        std::vector<uint16_t> b(t.data.size());
        for (size_t i = 0; i < b.size(); ++i)
          b[i] = dtype == st_dtype::bf16 ? quant::bf16_from_float(t.data[i]) : f16_bits(t.data[i], path, name);
        f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size() * 2));
      }
    }
    write_close_checked(f, tmp);
  }
  fs::rename(tmp, path);
}

st_tensors safetensors_load_dir(const std::string& dir, std::map<std::string, std::string>* file_of) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    st_tensors t = safetensors_read(single.string());
    if (file_of)
      for (const auto& [n, x] : t) (*file_of)[n] = single.string();
    return t;
  }
  if (!fs::exists(index)) throw st_error(dir + ": neither model.safetensors nor model.safetensors.index.json exists");
  json j;
  try {
    j = json_file_read(index.string());
  } catch (const std::invalid_argument& e) {
    throw st_error(e.what());
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw st_error(index.string() + ": missing object 'weight_map'");
  std::map<std::string, std::vector<std::string>> shards;  // file -> tensor names
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) throw st_error(index.string() + ": weight_map['" + it.key() + "'] is not a file name");
    const std::string file = it.value().get<std::string>();
    if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
      throw st_error(index.string() + ": weight_map['" + it.key() + "'] names a path outside the directory");
    shards[file].push_back(it.key());
  }
  st_tensors out;
  for (const auto& [file, names] : shards) {
    st_tensors part = safetensors_read((fs::path(dir) / file).string());
    for (const auto& n : names) {
      auto it = part.find(n);
      if (it == part.end()) throw st_error((fs::path(dir) / file).string() + ": tensor '" + n + "' listed in the index is missing");
      out.emplace(n, std::move(it->second));
      part.erase(it);
      if (file_of) (*file_of)[n] = (fs::path(dir) / file).string();
    }
    // a tensor the index does not list: a shard of another save, or an index written before it
    if (!part.empty())
      throw st_error((fs::path(dir) / file).string() + ": tensor '" + part.begin()->first + "' is not in " + index.string() +
                     "'s weight_map" + (part.size() > 1 ? " (and " + std::to_string(part.size() - 1) + " more)" : ""));
  }
  return out;
}

}  // namespace fp8rl::models
