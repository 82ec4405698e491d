// models/tokenizer.hpp -- tokenizers: a built-in character-level tokenizer for the built-in tasks,
// and Hugging Face tokenizer.json byte-level BPE (Llama 3, SmolLM, Qwen2 format).
// defines: tokenizer, char_tokenizer_make, tokenizer_load, char_tokenizer_save, tokenizer_copy,
//          tokenizer_file, tokenizer_file_read, tokenizer_file_write, tokenizer_make, tokenizer_vocab_check
//
// tokenizer.json support: added (special) tokens matched first; normalizer null or NFC (NFC is
// the identity on ASCII; non-ASCII text with an NFC normalizer is an error, not silently
// unnormalized); pre-tokenizers Split (regex, Isolated), ByteLevel (with or without its GPT-2
// regex), Sequence; model BPE (merges as "a b" or [a, b], ignore_merges); post-processors
// TemplateProcessing, ByteLevel or none; decoder ByteLevel. Anything else is an error naming
// the key. Checked against @huggingface/tokenizers (tests/models/tokenizer_test.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl::models {

class tokenizer {
 public:
  virtual ~tokenizer() = default;
  // add_special: apply the post-processor template (e.g. prepend BOS).
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special = false) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t token_id(std::string_view token) const = 0;  // -1 when absent
  int32_t bos = -1, eos = -1, pad = -1;
};

// ids: 0 <pad>, 1 <bos>, 2 <eos>, then one id per character of `alphabet` (ASCII).
std::unique_ptr<tokenizer> char_tokenizer_make(const std::string& alphabet);
// A tokenizer.json file, or a directory holding tokenizer.json or fp8rl-char-tokenizer.json
// ({"type": "fp8rl-char", "alphabet": "..."}, written by char_tokenizer_save).
std::unique_ptr<tokenizer> tokenizer_load(const std::string& path);
void char_tokenizer_save(const std::string& dir, const std::string& alphabet);
// Copies the tokenizer `path` names (a file, or a directory as tokenizer_load reads it) into dir,
// named by its kind: fp8rl-char-tokenizer.json for fp8rl's character tokenizer (a char tokenizer
// given by its file went in as tokenizer.json, a name Hugging Face tools read as theirs), else
// tokenizer.json.
void tokenizer_copy(const std::string& path, const std::string& dir);
// A tokenizer's file as tokenizer_copy names it in a directory, and its bytes: read once at a run's
// start, written into each checkpoint (copied at each save instead, a start directory's tokenizer
// deleted during the run left the later checkpoints without one, and the run exited 0).
struct tokenizer_file {
  std::string name, bytes;
  std::string path;  // where it was read (errors name it)
};
tokenizer_file tokenizer_file_read(const std::string& path);
void tokenizer_file_write(const tokenizer_file& t, const std::string& dir);
// The tokenizer of a file read (tokenizer_load = tokenizer_make(tokenizer_file_read(path))).
std::unique_ptr<tokenizer> tokenizer_make(const tokenizer_file& t);
// Throws naming `where` (the tokenizer's file or directory) when its ids reach past the model's
// vocabulary: a text encoding to one of them indexed no embedding row.
void tokenizer_vocab_check(const tokenizer& tok, int64_t vocab_size, const std::string& where);

}  // namespace fp8rl::models
