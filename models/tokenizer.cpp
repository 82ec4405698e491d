// models/tokenizer.cpp -- character tokenizer and HF byte-level BPE (PCRE2 for pre-tokenizer regexes).
#include "models/tokenizer.hpp"

#include <pcre2.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <unordered_map>

#include "models/json_io.hpp"

namespace fp8rl::models {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------- character tokenizer
class char_tok final : public tokenizer {
 public:
  explicit char_tok(const std::string& alphabet) : chars_(alphabet) {
    bos = 1; eos = 2; pad = 0;
    for (size_t i = 0; i < alphabet.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(alphabet[i]);
      if (c >= 128) throw std::invalid_argument("char tokenizer: alphabet must be ASCII");
      if (id_[c] >= 0) throw std::invalid_argument(std::string("char tokenizer: duplicate character '") + alphabet[i] + "'");
      id_[c] = static_cast<int32_t>(3 + i);
    }
  }
  std::vector<int32_t> encode(std::string_view text, bool add_special) const override {
    std::vector<int32_t> ids;
    if (add_special) ids.push_back(bos);
    for (size_t i = 0; i < text.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      if (c >= 128 || id_[c] < 0)
        throw std::invalid_argument("char tokenizer: character '" + std::string(1, text[i]) + "' at offset " +
                                    std::to_string(i) + " is not in the alphabet");
      ids.push_back(id_[c]);
    }
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::string s;
    for (int32_t id : ids) {
      if (id >= 3 && id < 3 + static_cast<int32_t>(chars_.size())) s += chars_[static_cast<size_t>(id - 3)];
      else if (!skip_special) s += id == 0 ? "<pad>" : id == 1 ? "<bos>" : id == 2 ? "<eos>" : "<?>";
    }
    return s;
  }
  int64_t vocab_size() const override { return 3 + static_cast<int64_t>(chars_.size()); }
  int32_t token_id(std::string_view t) const override {
    if (t == "<pad>") return 0;
    if (t == "<bos>") return 1;
    if (t == "<eos>") return 2;
    if (t.size() == 1 && static_cast<unsigned char>(t[0]) < 128) return id_[static_cast<unsigned char>(t[0])];
    return -1;
  }

 private:
  std::string chars_;
  int32_t id_[128] = {};
  struct init { init(int32_t* a) { for (int i = 0; i < 128; ++i) a[i] = -1; } } init_{id_};
};

// ---------------------------------------------------------------- byte-level BPE
std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) s += static_cast<char>(cp);
  else if (cp < 0x800) { s += static_cast<char>(0xc0 | (cp >> 6)); s += static_cast<char>(0x80 | (cp & 0x3f)); }
  else if (cp < 0x10000) {
    s += static_cast<char>(0xe0 | (cp >> 12)); s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    s += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    s += static_cast<char>(0xf0 | (cp >> 18)); s += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f)); s += static_cast<char>(0x80 | (cp & 0x3f));
  }
  return s;
}

// Splits a UTF-8 string into code-point substrings.
std::vector<std::string> utf8_chars(const std::string& s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
    if (i + n > s.size()) n = s.size() - i;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

class regex {
 public:
  regex(const std::string& pattern, const std::string& where) {
    int err;
    PCRE2_SIZE off;
    re_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    if (!re_) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof buf);
      throw std::invalid_argument(where + ": regex does not compile at offset " + std::to_string(off) + ": " +
                                  reinterpret_cast<char*>(buf));
    }
  }
  ~regex() { pcre2_code_free(re_); }
  regex(const regex&) = delete;
  regex& operator=(const regex&) = delete;
  // Isolated split: matches and the gaps between them, in order, non-empty. Match data per call:
  // one tokenizer encodes from several actors' threads at once (a compiled pattern may be shared,
  // match data may not: one member's was, and concurrent encodes read each other's offsets).
  std::vector<std::string> split(const std::string& s) const {
    const std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data*)> md(pcre2_match_data_create_from_pattern(re_, nullptr),
                                                                            pcre2_match_data_free);
    if (!md) throw std::bad_alloc();
    std::vector<std::string> out;
    size_t pos = 0, last = 0;
    while (pos <= s.size()) {
      const int rc = pcre2_match(re_, reinterpret_cast<PCRE2_SPTR>(s.c_str()), s.size(), pos, 0, md.get(), nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step one code point
        pos = b + 1;
        while (pos < s.size() && (static_cast<unsigned char>(s[pos]) & 0xc0) == 0x80) ++pos;
        continue;
      }
      if (b > last) out.push_back(s.substr(last, b - last));
      out.push_back(s.substr(b, e - b));
      last = pos = e;
    }
    if (last < s.size()) out.push_back(s.substr(last));
    return out;
  }

 private:
  pcre2_code* re_ = nullptr;
};

const char* kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

class bpe_tok final : public tokenizer {
 public:
  bpe_tok(const json& j, const std::string& src) {
    auto where = [&](const std::string& k) { return src + ": " + k; };
    byte_tables();
    // model
    if (!j.contains("model") || !j["model"].is_object()) throw std::invalid_argument(where("'model' missing"));
    const json& m = j["model"];
    if (m.value("type", "") != "BPE") throw std::invalid_argument(where("model.type '" + m.value("type", "?") + "' is not supported (BPE only)"));
    if (m.contains("byte_fallback") && m["byte_fallback"] == true) throw std::invalid_argument(where("model.byte_fallback is not supported"));
    // settings that change how text splits: refused unless off (they were ignored)
    for (const char* k : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"})
      if (m.contains(k) && !m[k].is_null() && m[k] != "" && m[k] != 0)
        throw std::invalid_argument(where(std::string("model.") + k + " = " + m[k].dump() + " is not supported (null)"));
    if (!m.contains("vocab") || !m["vocab"].is_object()) throw std::invalid_argument(where("model.vocab missing"));
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      add_token(it.key(), it.value(), where("model.vocab['" + it.key() + "']"));
    }
    ignore_merges_ = m.value("ignore_merges", false);
    if (!m.contains("merges") || !m["merges"].is_array()) throw std::invalid_argument(where("model.merges missing"));
    int32_t rank = 0;
    for (const auto& e : m["merges"]) {
      std::string a, b;
      if (e.is_string()) {
        const std::string s = e.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          throw std::invalid_argument(where("model.merges[" + std::to_string(rank) + "] '" + s + "' is not two symbols and a space"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        a = e[0].get<std::string>();
        b = e[1].get<std::string>();
      } else {
        throw std::invalid_argument(where("model.merges[" + std::to_string(rank) + "] is malformed"));
      }
      ranks_.emplace(a + '\x01' + b, rank++);
    }
    // added tokens
    if (j.contains("added_tokens") && !j["added_tokens"].is_null() && !j["added_tokens"].is_array())
      throw std::invalid_argument(where("added_tokens must be a list"));  // was ignored: its special tokens lost
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& t : j["added_tokens"]) {
        if (!t.is_object() || !t.contains("content") || !t["content"].is_string() || t["content"].get<std::string>().empty() ||
            !t.contains("id"))
          throw std::invalid_argument(where("added_tokens entry needs content and id"));
        const std::string c = t["content"].get<std::string>();
        const int32_t id = add_token(c, t["id"], where("added_tokens '" + c + "'"));
        added_.emplace_back(c, id);
        if (t.value("special", false)) special_.insert({id, true});
      }
    std::sort(added_.begin(), added_.end(), [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
    // normalizer
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      const std::string t = j["normalizer"].value("type", "");
      if (t != "NFC") throw std::invalid_argument(where("normalizer type '" + t + "' is not supported (null, NFC)"));
      nfc_ = true;
    }
    // pre-tokenizer
    if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) add_pre(j["pre_tokenizer"], where("pre_tokenizer"));
    // post-processor
    if (j.contains("post_processor") && !j["post_processor"].is_null()) add_post(j["post_processor"], where("post_processor"));
    if (j.contains("decoder") && !j["decoder"].is_null() && j["decoder"].value("type", "") != "ByteLevel")
      throw std::invalid_argument(where("decoder type '" + j["decoder"].value("type", "") + "' is not supported (ByteLevel)"));
    for (const char* n : {"<|begin_of_text|>", "<s>", "<|im_start|>"}) if (bos < 0) bos = token_id(n);
    for (const char* n : {"<|end_of_text|>", "</s>", "<|endoftext|>", "<|im_end|>"}) if (eos < 0) eos = token_id(n);
    if (!prefix_.empty()) bos = prefix_.front();
  }

  std::vector<int32_t> encode(std::string_view text, bool add_special) const override {
    std::vector<int32_t> ids;
    if (add_special) ids = prefix_;
    // split on added tokens (longest first at each position)
    std::string pending;
    size_t i = 0;
    while (i < text.size()) {
      bool hit = false;
      for (const auto& [c, id] : added_)
        if (text.compare(i, c.size(), c) == 0) {
          encode_text(pending, ids);
          pending.clear();
          ids.push_back(id);
          i += c.size();
          hit = true;
          break;
        }
      if (!hit) pending += text[i++];
    }
    encode_text(pending, ids);
    if (add_special) ids.insert(ids.end(), suffix_.begin(), suffix_.end());
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    std::string bytes;
    for (int32_t id : ids) {
      if (id < 0 || id >= static_cast<int32_t>(by_id_.size()) || by_id_[id].empty())
        throw std::invalid_argument("decode: id " + std::to_string(id) + " is not in the vocabulary");
      if (special_.count(id)) {
        if (!skip_special) bytes += by_id_[id];
        continue;
      }
      for (const auto& ch : utf8_chars(by_id_[id])) {
        auto it = unbyte_.find(ch);
        if (it == unbyte_.end()) bytes += ch;  // an added non-byte-level token: raw text
        else bytes += static_cast<char>(it->second);
      }
    }
    return bytes;
  }
  int64_t vocab_size() const override { return static_cast<int64_t>(by_id_.size()); }
  int32_t token_id(std::string_view t) const override {
    auto it = vocab_.find(std::string(t));
    return it == vocab_.end() ? -1 : it->second;
  }

 private:
  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> by_id_;
  std::unordered_map<std::string, int32_t> ranks_;  // "a\x01b" -> rank
  std::vector<std::pair<std::string, int32_t>> added_;
  std::map<int32_t, bool> special_;
  std::string byte_char_[256];
  std::unordered_map<std::string, uint8_t> unbyte_;
  // The pre-tokenizers in their order (HF applies each to every piece the ones before it made):
  // Split (its regex) or ByteLevel (a space before each piece not starting with one, if asked;
  // GPT-2's regex unless use_regex is false).
  struct pre_step {
    std::unique_ptr<regex> re;
    bool prefix_space = false;
  };
  std::vector<pre_step> pre_;
  bool byte_level_ = false, ignore_merges_ = false, nfc_ = false;
  std::vector<int32_t> prefix_, suffix_;

  // Token t with the id JSON value v (at `where`): an integer in [0, kMaxTokenId), and no other
  // token's (a negative id wrote before the table, a huge one allocated it, a wide one wrapped).
  static constexpr int64_t kMaxTokenId = int64_t{1} << 24;
  int32_t add_token(const std::string& t, const json& v, const std::string& where) {
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() >= uint64_t(kMaxTokenId)) ||
        v.get<int64_t>() < 0 || v.get<int64_t>() >= kMaxTokenId)
      throw std::invalid_argument(where + ": id " + v.dump() + " is not an integer in [0, " + std::to_string(kMaxTokenId) + ")");
    const auto id = static_cast<int32_t>(v.get<int64_t>());
    if (static_cast<size_t>(id) >= by_id_.size()) by_id_.resize(static_cast<size_t>(id) + 1);
    if (!by_id_[static_cast<size_t>(id)].empty() && by_id_[static_cast<size_t>(id)] != t)
      throw std::invalid_argument(where + ": id " + std::to_string(id) + " is also '" + by_id_[static_cast<size_t>(id)] + "'");
    vocab_[t] = id;
    by_id_[static_cast<size_t>(id)] = t;
    return id;
  }

  void byte_tables() {  // GPT-2 bytes_to_unicode
    std::vector<int> bs, cs;
    for (int b = 33; b <= 126; ++b) bs.push_back(b);
    for (int b = 161; b <= 172; ++b) bs.push_back(b);
    for (int b = 174; b <= 255; ++b) bs.push_back(b);
    cs = bs;
    int n = 0;
    for (int b = 0; b < 256; ++b)
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) { bs.push_back(b); cs.push_back(256 + n++); }
    for (size_t i = 0; i < bs.size(); ++i) {
      byte_char_[bs[i]] = utf8(static_cast<uint32_t>(cs[i]));
      unbyte_[byte_char_[bs[i]]] = static_cast<uint8_t>(bs[i]);
    }
  }

  // TemplateProcessing (the special tokens around a single sequence), ByteLevel (offsets only), or
  // a Sequence of them (Llama 3's tokenizer.json: [ByteLevel, TemplateProcessing]).
  void add_post(const json& p, const std::string& where) {
    const std::string t = p.is_object() ? p.value("type", "") : "";
    if (t == "Sequence") {
      if (!p.contains("processors") || !p["processors"].is_array())
        throw std::invalid_argument(where + ": a Sequence needs a list 'processors'");
      for (const auto& q : p["processors"]) add_post(q, where + ".processors");
    } else if (t == "TemplateProcessing") {
      if (!p.contains("single") || !p["single"].is_array())
        throw std::invalid_argument(where + ": TemplateProcessing needs a list 'single'");
      bool seen_seq = false;
      for (const auto& piece : p["single"]) {
        if (piece.contains("SpecialToken")) {
          const json& sp = piece["SpecialToken"];
          if (!sp.is_object() || !sp.contains("id") || !sp["id"].is_string())
            throw std::invalid_argument(where + ": SpecialToken needs a string 'id'");
          const std::string id = sp["id"].get<std::string>();
          const int32_t tid = token_id(id);
          if (tid < 0) throw std::invalid_argument(where + ": special token '" + id + "' is not in the vocabulary");
          (seen_seq ? suffix_ : prefix_).push_back(tid);
        } else if (piece.contains("Sequence")) {
          seen_seq = true;
        } else {
          throw std::invalid_argument(where + ": TemplateProcessing piece " + piece.dump() + " is neither SpecialToken nor Sequence");
        }
      }
    } else if (t != "ByteLevel") {
      throw std::invalid_argument(where + ": type '" + t + "' is not supported (TemplateProcessing, ByteLevel, Sequence)");
    }
  }

  void add_pre(const json& p, const std::string& where) {
    const std::string t = p.value("type", "");
    if (t == "Sequence") {  // (a const json's [] of a missing key reads past its map: no assert in Release)
      if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array())
        throw std::invalid_argument(where + ": a Sequence needs a list 'pretokenizers'");
      for (const auto& q : p["pretokenizers"]) add_pre(q, where + ".pretokenizers");
    } else if (t == "Split") {
      if (p.value("behavior", "") != "Isolated" || p.value("invert", false))
        throw std::invalid_argument(where + ": Split behavior must be Isolated (invert false)");
      if (!p.contains("pattern") || !p["pattern"].contains("Regex"))
        throw std::invalid_argument(where + ": Split needs pattern.Regex");
      // after ByteLevel, HF splits the byte symbols (a space is 'Ġ' there); pieces here stay bytes
      if (byte_level_) throw std::invalid_argument(where + ": a Split after ByteLevel is not supported (Split first)");
      pre_.push_back({std::make_unique<regex>(p["pattern"]["Regex"].get<std::string>(), where), false});
    } else if (t == "ByteLevel") {
      byte_level_ = true;
      pre_.push_back({p.value("use_regex", true) ? std::make_unique<regex>(kGpt2Pattern, where) : nullptr,
                      p.value("add_prefix_space", false)});
    } else {
      throw std::invalid_argument(where + ": pre-tokenizer type '" + t + "' is not supported");
    }
  }

  void encode_text(std::string text, std::vector<int32_t>& ids) const {
    if (text.empty()) return;
    if (nfc_)
      for (unsigned char c : text)
        if (c >= 0x80) throw std::invalid_argument("tokenizer: NFC normalization of non-ASCII text is not implemented");
    std::vector<std::string> pieces = {std::move(text)};
    for (const auto& step : pre_) {
      std::vector<std::string> next;
      for (auto& p : pieces) {
        if (step.prefix_space && p[0] != ' ') p.insert(p.begin(), ' ');
        if (!step.re) next.push_back(std::move(p));
        else for (auto& q : step.re->split(p)) next.push_back(std::move(q));
      }
      pieces.swap(next);
    }
    for (const auto& p : pieces) bpe(p, ids);
  }

  void bpe(const std::string& raw, std::vector<int32_t>& ids) const {
    std::vector<std::string> sym;
    std::string word;
    for (unsigned char c : raw) {
      sym.push_back(byte_level_ ? byte_char_[c] : std::string(1, static_cast<char>(c)));
      word += sym.back();
    }
    if (ignore_merges_) {
      auto it = vocab_.find(word);
      if (it != vocab_.end()) { ids.push_back(it->second); return; }
    }
    while (sym.size() > 1) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        auto it = ranks_.find(sym[i] + '\x01' + sym[i + 1]);
        if (it != ranks_.end() && it->second < best) { best = it->second; at = i; }
      }
      if (best == INT32_MAX) break;
      sym[at] += sym[at + 1];
      sym.erase(sym.begin() + static_cast<long>(at) + 1);
    }
    for (const auto& s : sym) {
      auto it = vocab_.find(s);
      if (it == vocab_.end()) throw std::invalid_argument("tokenizer: symbol '" + s + "' has no id (vocabulary incomplete)");
      ids.push_back(it->second);
    }
  }
};

}  // namespace

std::unique_ptr<tokenizer> char_tokenizer_make(const std::string& alphabet) { return std::make_unique<char_tok>(alphabet); }

void tokenizer_vocab_check(const tokenizer& tok, int64_t vocab_size, const std::string& where) {
  if (tok.vocab_size() > vocab_size)
    throw std::invalid_argument(where + ": the tokenizer has " + std::to_string(tok.vocab_size()) +
                                " tokens, the model's vocab_size (config.json) is " + std::to_string(vocab_size));
}

namespace {
constexpr const char* kCharFile = "fp8rl-char-tokenizer.json";
bool is_char_tokenizer(const json& j) { return j.is_object() && j.value("type", "") == "fp8rl-char"; }

// The tokenizer file `path` names: itself, or a directory's fp8rl-char-tokenizer.json, else its
// tokenizer.json.
std::string tokenizer_path(const std::string& path) {
  if (!std::filesystem::is_directory(path)) return path;
  const auto chr = std::filesystem::path(path) / kCharFile;
  const std::string file = std::filesystem::exists(chr) ? chr.string() : (std::filesystem::path(path) / "tokenizer.json").string();
  if (!std::filesystem::exists(file))
    throw std::invalid_argument(path + ": no tokenizer (neither tokenizer.json nor " + kCharFile + ")");
  return file;
}
}  // namespace

tokenizer_file tokenizer_file_read(const std::string& path) {
  tokenizer_file t;
  t.path = tokenizer_path(path);
  t.bytes = file_text_read(t.path);
  t.name = is_char_tokenizer(json_parse_strict(t.bytes, t.path)) ? kCharFile : "tokenizer.json";
  return t;
}

void tokenizer_file_write(const tokenizer_file& t, const std::string& dir) {
  file_write_checked((std::filesystem::path(dir) / t.name).string(), t.bytes);
}

void tokenizer_copy(const std::string& path, const std::string& dir) { tokenizer_file_write(tokenizer_file_read(path), dir); }

std::unique_ptr<tokenizer> tokenizer_load(const std::string& path) { return tokenizer_make(tokenizer_file_read(path)); }

std::unique_ptr<tokenizer> tokenizer_make(const tokenizer_file& t) {
  const std::string& file = t.path;
  const json j = json_parse_strict(t.bytes, file);
  if (is_char_tokenizer(j)) {
    if (!j.contains("alphabet") || !j["alphabet"].is_string()) throw std::invalid_argument(file + ": 'alphabet' missing");
    try {
      return char_tokenizer_make(j["alphabet"].get<std::string>());
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(file + ": " + e.what());  // non-ASCII or repeated characters
    }
  }
  try {
    return std::make_unique<bpe_tok>(j, file);
  } catch (const json::exception& e) {  // a field of the wrong type: name the file (the checks name the field)
    throw std::invalid_argument(file + ": malformed (" + std::string(e.what()) + ")");
  }
}

void char_tokenizer_save(const std::string& dir, const std::string& alphabet) {
  file_write_checked((std::filesystem::path(dir) / kCharFile).string(),
                     json{{"type", "fp8rl-char"}, {"alphabet", alphabet}}.dump() + "\n");
}

}  // namespace fp8rl::models
