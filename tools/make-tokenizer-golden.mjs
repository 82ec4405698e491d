// tools/make-tokenizer-golden.mjs -- writes tests/models/golden-tokenizer/: a Llama-3-format
// byte-level BPE tokenizer.json (the real Llama 3 vocabulary cut to its first MERGES merges, so
// the file stays small) and the token ids that Hugging Face's reference implementation
// (@huggingface/tokenizers, pure JS) produces for a set of test strings (expected.json), and for
// other pre-tokenizer orders and settings over the same vocabulary (pre-tokenizers.json).
// Dev-time only (never a runtime dependency). Run:
//   d=$(mktemp -d) && cd $d && npm install @huggingface/tokenizers@0.2.0 llama3-tokenizer-js@1.2.0 \
//     && node /path/to/fp8rl/tools/make-tokenizer-golden.mjs /path/to/fp8rl/tests/models/golden-tokenizer
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const out = process.argv[2];
const MERGES = 4000;
const mod = (name) => import(pathToFileURL(path.join(process.cwd(), "node_modules", name, JSON.parse(
  fs.readFileSync(path.join(process.cwd(), "node_modules", name, "package.json"))).module || "index.js")).href);
const llama3 = (await import(pathToFileURL(path.join(process.cwd(), "node_modules/llama3-tokenizer-js/bundle/llama3-tokenizer-with-baked-data.js")).href)).default;
const { Tokenizer } = await mod("@huggingface/tokenizers");

// GPT-2 bytes_to_unicode: the 256 base symbols of byte-level BPE
const bs = [];
for (let b = 33; b <= 126; b++) bs.push(b);
for (let b = 161; b <= 172; b++) bs.push(b);
for (let b = 174; b <= 255; b++) bs.push(b);
const cs = [...bs];
let n = 0;
for (let b = 0; b < 256; b++) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n); n++; }
const byteChar = new Map(bs.map((b, i) => [b, String.fromCodePoint(cs[i])]));

const vocab = {};
let next = 0;
for (let b = 0; b < 256; b++) vocab[byteChar.get(b)] = next++;
const merges = [];
const ranked = [...llama3.merges.entries()].sort((a, b) => a[1] - b[1]).map((e) => e[0]);
for (const m of ranked) {
  if (merges.length >= MERGES) break;
  const [a, b] = m.split(" ");
  if (!(a in vocab) || !(b in vocab)) continue;
  merges.push(m);
  if (!((a + b) in vocab)) vocab[a + b] = next++;
}
const specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"];
const added = specials.map((s, i) => ({ id: next + i, content: s, single_word: false, lstrip: false, rstrip: false,
                                        normalized: false, special: true }));
const pattern = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const tok = {
  version: "1.0", truncation: null, padding: null, added_tokens: added, normalizer: null,
  pre_tokenizer: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: pattern }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: false }] },
  post_processor: { type: "TemplateProcessing",
    single: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } }],
    pair: [{ SpecialToken: { id: "<|begin_of_text|>", type_id: 0 } }, { Sequence: { id: "A", type_id: 0 } },
           { Sequence: { id: "B", type_id: 1 } }],
    special_tokens: { "<|begin_of_text|>": { id: "<|begin_of_text|>", ids: [next], tokens: ["<|begin_of_text|>"] } } },
  decoder: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
  model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
           fuse_unk: false, byte_fallback: false, ignore_merges: true, vocab, merges },
};
fs.mkdirSync(out, { recursive: true });
fs.writeFileSync(path.join(out, "tokenizer.json"), JSON.stringify(tok));

const strings = [
  "Hello world!", "  leading and trailing  ", "numbers 1234567 and 3.14159, 1,000,000", "don't I'll WE'RE they've",
  "tabs\tand\nnewlines\n\n\nend", "unicode: héllo wörld — 日本語 😀 ñ", "<|eot_id|> special inside<|end_of_text|> text",
  "", "!!!???...;;", "a b  c   d    e", "def f(x):\n    return x**2 + 1  # comment", "12+34=46", "The quick brown fox.",
  "ÀÉÎÕÜ çà\u00a0nbsp", "x\r\ny\rz", "multiple     spaces\t\t\ttabs",
];
const ref = new Tokenizer(tok, {});
const cases = strings.map((s) => ({
  text: s,
  ids: ref.encode(s, { add_special_tokens: false }).ids,
  ids_with_bos: ref.encode(s).ids,
}));
fs.writeFileSync(path.join(out, "expected.json"), JSON.stringify({ reference: "@huggingface/tokenizers@0.2.0", merges: merges.length, cases }, null, 1));
// pre-tokenizers in other orders and settings (the same vocabulary): each applies to every piece the
// ones before it made -- ByteLevel's add_prefix_space puts a space before each piece, not the text
const pre = {
  split_then_prefixed_bytes: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: "\\p{N}+" }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: false }] },
  prefixed_gpt2: { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
  two_splits_then_gpt2: { type: "Sequence", pretokenizers: [
    { type: "Split", pattern: { Regex: "\\p{N}" }, behavior: "Isolated", invert: false },
    { type: "Split", pattern: { Regex: "=" }, behavior: "Isolated", invert: false },
    { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true }] },
};
const preStrings = ["a1b", "hello 42 world", "12+34=46", " lead", "x  y", "don't stop"];
const preCases = Object.entries(pre).map(([name, p]) => {
  const t = new Tokenizer({ ...tok, pre_tokenizer: p }, {});
  return { name, pre_tokenizer: p, cases: preStrings.map((s) => ({ text: s, ids: t.encode(s, { add_special_tokens: false }).ids })) };
});
fs.writeFileSync(path.join(out, "pre-tokenizers.json"), JSON.stringify({ reference: "@huggingface/tokenizers@0.2.0", variants: preCases }, null, 1));
// cross-check: on the full Llama 3 vocabulary both JS references agree with each other
console.log(`wrote ${out}: vocab ${next + specials.length}, merges ${merges.length}, ${cases.length} cases`);
