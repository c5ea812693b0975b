// apps/train/text_data.h: real text for strata-train, as bytes: the sources of a directory of
// Python files (the standard library's, which every machine with Python has), so that a run's loss
// says how well the model learns text, not a synthetic rule.
//
// Example:
//   STRATA_ASSIGN_OR_RETURN(TextCorpus text, TextCorpus::load("/usr/lib/python3.11", 8 << 20));
//   torch::Tensor tokens = text.batch(config, /*seed=*/7, /*step=*/1);  // [batch, seq + 1] bytes
#pragma once

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "apps/train/gpt.h"

namespace strata::apps {

class TextCorpus {
 public:
  // The *.py files directly under `dir`, in name order, concatenated up to `max_bytes`;
  // kNotFound when there are none, kInvalidArgument when they hold fewer bytes than one sequence
  // needs.
  static absl::StatusOr<TextCorpus> load(const std::string& dir, std::int64_t max_bytes);

  // The step's batch, [batch, seq + 1] int64 on the CPU: sequences of bytes starting at offsets
  // drawn from (seed, step), the same on every machine with the same files.
  torch::Tensor batch(const GptConfig& config, std::uint64_t seed, int step) const;

  std::int64_t size() const { return static_cast<std::int64_t>(bytes_.size()); }
  int files() const { return files_; }

 private:
  std::string bytes_;
  int files_ = 0;
};

}  // namespace strata::apps
