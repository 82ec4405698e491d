// models/rl/task.hpp -- tasks for RL with verifiable rewards: user datasets and the built-in
// arithmetic family, and the verifiers that score a response.
// defines: task_example, dataset, dataset_load_jsonl, example_where, dataset_fingerprint, verifier_kind,
//          answer_forms, answer_is_number, verify, answer_normalize,
//          arithmetic_config, arithmetic_dataset, arithmetic_alphabet
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8rl::models {

struct task_example {
  std::string prompt;
  std::string answer;
  int64_t line = 0;  // its line in the source JSONL (0: generated)
};

struct dataset {
  std::string source;
  std::vector<task_example> items;
};

// JSONL lines {"prompt": "...", "answer": "..." | number}; blank lines skipped. Every malformed
// line is reported (all of them, with line numbers) in one std::invalid_argument.
dataset dataset_load_jsonl(const std::string& path);
// Where example i of d comes from, for errors: "FILE:LINE", or "SOURCE example i" (generated).
std::string example_where(const dataset& d, size_t i);
// FNV-1a 64 of the examples in order (prompt, answer; lines and source left out), 16 hex digits:
// a checkpoint records its training set's, and --resume refuses another (its prompt cursor
// would go on in other prompts).
std::string dataset_fingerprint(const dataset& d);

enum class verifier_kind : uint8_t { exact = 0, numeric = 1 };
std::optional<verifier_kind> verifier_parse(std::string_view s);

// Trim, collapse internal whitespace, lowercase, drop one trailing period.
std::string answer_normalize(std::string_view s);
// Response texts verify(k, ., answer) accepts, for counting the tokens one takes (near the
// fewest: the numeric tolerance accepts shorter ones still, 0 for 1e-7): the answer trimmed and
// normalized (exact; a case-sensitive tokenizer may encode either in fewer), the number in its
// shortest fixed-notation form ("100000", what a model writes) and, where shorter, scientific
// ("1e+30"; the answer itself where it is no number, which no response matches).
std::vector<std::string> answer_forms(verifier_kind k, std::string_view answer);
// Whether the numeric verifier reads `answer` as a number (else no response matches it).
bool answer_is_number(std::string_view answer);
// 1 if the response matches the answer, else 0. numeric: both parse as numbers (commas and a
// leading '+' ignored) and agree to 1e-6 relative; a response that does not parse scores 0.
float verify(verifier_kind k, std::string_view response, std::string_view answer);

// Built-in arithmetic: "a+b=" -> "c" (or '*'), operands with `digits` digits (difficulty).
// Train and validation are disjoint by construction: an operand pair is validation iff a hash
// of (a, b) falls in the `val_fraction` bucket. Deterministic in the seed.
struct arithmetic_config {
  char op = '+';
  int digits = 2;
  double val_fraction = 0.1;
};
dataset arithmetic_dataset(const arithmetic_config& c, bool validation, int64_t n, uint64_t seed);
// Characters the built-in tasks use (for char_tokenizer_make).
std::string arithmetic_alphabet();

// A task spec: "builtin:add2" / "builtin:mul1" (op and digit count) or a JSONL path.
struct task_spec {
  bool builtin = false;
  arithmetic_config arith;
  std::string path;
};
task_spec task_spec_parse(const std::string& s);  // throws std::invalid_argument
// Train or validation split of a task: built-in (n examples), or the file itself.
dataset task_load(const task_spec& t, bool validation, int64_t n, uint64_t seed);

}  // namespace fp8rl::models
