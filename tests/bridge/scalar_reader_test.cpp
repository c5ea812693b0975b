// bridge::ScalarReader against .item(): every dtype, undefined tensors, errors; on the GPU, CUDA
// scalars of every dtype, mixed with CPU ones, and values written by work still queued when the
// read starts (the read waits for torch's stream, never returns a stale slot).
#include "bridge/scalar_reader.h"

#include <cmath>
#include <limits>
#include <vector>

#include "allocator/upstream.h"
#include "gtest/gtest.h"
#include "torch/torch.h"

namespace strata::bridge {
namespace {

std::vector<torch::Tensor> every_dtype(torch::Device device) {
  const auto on = torch::TensorOptions().device(device);
  return {torch::tensor(3.140625f, on),
          torch::tensor(0.1, on.dtype(torch::kDouble)),
          torch::tensor(3.140625f, on).to(torch::kBFloat16),
          torch::tensor(3.140625f, on).to(torch::kHalf),
          torch::tensor(-7, on.dtype(torch::kLong)),
          torch::tensor(true, on.dtype(torch::kBool)),
          torch::full({1}, -std::numeric_limits<float>::infinity(), on),
          (torch::ones({3}, on.requires_grad(true)) * 2).sum()};  // a loss, part of a graph
}

void expect_reads_as_item(const std::vector<torch::Tensor>& scalars) {
  ScalarReader reader;
  const std::vector<double> got = reader.read(scalars);
  ASSERT_EQ(got.size(), scalars.size());
  for (std::size_t i = 0; i < scalars.size(); ++i) {
    EXPECT_EQ(got[i], scalars[i].item<double>()) << i << " " << scalars[i].dtype();
  }
}

TEST(ScalarReaderTest, ReadsAsItemDoesOnTheCpu) {
  expect_reads_as_item(every_dtype(torch::kCPU));
  ScalarReader reader;
  const std::vector<double> got = reader.read({torch::Tensor(), torch::tensor(2.5f)});
  EXPECT_TRUE(std::isnan(got[0]));
  EXPECT_EQ(got[1], 2.5);
  EXPECT_TRUE(reader.read({}).empty());
}

TEST(ScalarReaderTest, RefusesTensorsOfSeveralElements) {
  ScalarReader reader;
  EXPECT_THROW(reader.read({torch::tensor(1.0f), torch::zeros({2})}), c10::Error);
}

class ScalarReaderGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (alloc::cuda_device_count() == 0 || !torch::cuda::is_available()) {
      GTEST_SKIP() << "no GPU on this machine";
    }
  }
};

TEST_F(ScalarReaderGpuTest, ReadsAsItemDoesOnTheGpu) {
  expect_reads_as_item(every_dtype(torch::kCUDA));
  std::vector<torch::Tensor> mixed = every_dtype(torch::kCUDA);
  mixed.push_back(torch::tensor(1.5f));  // a CPU scalar among CUDA ones
  expect_reads_as_item(mixed);
}

TEST_F(ScalarReaderGpuTest, WaitsForTheWorkThatWritesTheValue) {
  const torch::Tensor a = torch::randn({4096, 4096}, torch::kCUDA);
  ScalarReader reader;  // one reader, its buffer reused
  for (int k = 1; k <= 5; ++k) {
    torch::Tensor x = a;
    for (int i = 0; i < 8; ++i) x = torch::matmul(x, a) / 64.0;
    const torch::Tensor value = x.sum() + k;
    const double got = reader.read({value})[0];
    EXPECT_EQ(got, value.item<double>()) << k;
  }
}

}  // namespace
}  // namespace strata::bridge
