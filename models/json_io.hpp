// models/json_io.hpp -- JSON read strictly from user files: a key twice in one object is an error
// naming it (nlohmann keeps the last one silently: a duplicated rope_theta changed the model, a
// second safetensors entry replaced a tensor), and a directory or unreadable file is named.
// defines: json_parse_strict, json_file_read
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace fp8rl::models {

// Parses text; throws std::invalid_argument "<where>: not valid JSON: ..." or "<where>: key 'k'
// appears twice in one object" (no "<where>: " when where is empty).
nlohmann::json json_parse_strict(std::string_view text, const std::string& where);
// Reads and parses the file at path (errors name it: "not a file", "cannot open", as above).
nlohmann::json json_file_read(const std::string& path);

}  // namespace fp8rl::models
