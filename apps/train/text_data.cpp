#include "apps/train/text_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "base/strings.h"

namespace strata::apps {

absl::StatusOr<TextCorpus> TextCorpus::load(const std::string& dir, std::int64_t max_bytes) {
  std::error_code ec;
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".py") paths.push_back(entry.path());
  }
  if (ec || paths.empty()) {
    return absl::NotFoundError(str_cat("--text_dir: no *.py files in '", dir, "'",
                                       ec ? str_cat(" (", ec.message(), ")") : ""));
  }
  std::sort(paths.begin(), paths.end());
  TextCorpus out;
  for (const auto& path : paths) {
    if (out.size() >= max_bytes) break;
    std::ifstream in(path, std::ios::binary);
    out.bytes_.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    ++out.files_;
  }
  if (out.size() > max_bytes) out.bytes_.resize(static_cast<std::size_t>(max_bytes));
  return out;
}

torch::Tensor TextCorpus::batch(const GptConfig& config, std::uint64_t seed, int step) const {
  BatchRandom random(seed, step);
  const std::int64_t span = config.seq + 1;
  const auto starts = static_cast<std::uint64_t>(size() - span + 1);
  torch::Tensor out = torch::empty({config.batch, span}, torch::kInt64);
  auto a = out.accessor<std::int64_t, 2>();
  for (std::int64_t b = 0; b < config.batch; ++b) {
    const auto at = static_cast<std::int64_t>(random.next() % starts);
    for (std::int64_t t = 0; t < span; ++t) {
      a[b][t] = static_cast<unsigned char>(bytes_[static_cast<std::size_t>(at + t)]);
    }
  }
  return out;
}

}  // namespace strata::apps
