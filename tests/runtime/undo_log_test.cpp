// The undo log on its own (See Note [Undo log] in runtime/undo_log.cpp): keep_for_undo, commit_undo
// and rollback_undo through the runtime's API, with no optimizer. A tensor resting on the GPU is
// kept by a copy (to pinned host memory, or on the GPU with undo_on_gpu), a staged one by keeping
// its old home block; a rollback puts back exactly the bytes kept, a commit keeps what was written,
// and either leaves nothing allocated behind. Refusals change nothing.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "runtime/runtime.h"
#include "tests/runtime/runtime_test_util.h"

namespace strata::rt {
namespace {

using testing::Made;
using testing::make_runtime;
using testing::read_all;
using testing::spec;

constexpr std::size_t kN = 4096;  // floats per tensor

std::vector<unsigned char> pattern(float base) {
  std::vector<float> v(kN);
  for (std::size_t i = 0; i < kN; ++i) v[i] = base + static_cast<float>(i % 97) * 0.25f;
  std::vector<unsigned char> out(kN * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Queues a write of `bytes` into `dst` on `stream`, as a kernel stepping the tensor would.
void write_on(SimulatedDevice& dev, StreamHandle stream, void* dst,
              const std::vector<unsigned char>& bytes) {
  auto data = std::make_shared<std::vector<unsigned char>>(bytes);
  ASSERT_TRUE(
      dev.enqueue_host(stream, [dst, data] { std::memcpy(dst, data->data(), data->size()); }).ok());
}

std::int64_t pinned_in_use(Runtime& rt) {
  return rt.allocator().stats(Tier::kPinnedHost).allocated_bytes.current;
}

// A tensor resting on the GPU (keep_on_gpu), kept over the link or on the GPU, in deferred mode:
// the rollback restores the bytes from before the write, the commit keeps the write.
TEST(UndoLogTest, ARestingTensorIsRolledBackOrCommittedExactly) {
  for (const bool on_gpu : {false, true}) {
    for (const bool commit : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "undo on the GPU " << on_gpu << ", commit " << commit);
      PolicyConfig config;
      config.undo_on_gpu = on_gpu;
      auto [rt, dev] = make_runtime("keep_on_gpu", config, /*deferred=*/true);
      const std::vector<unsigned char> before = pattern(1.0f), after = pattern(-3.0f);
      absl::StatusOr<TensorHandle> h =
          rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
      ASSERT_TRUE(h.ok()) << h.status();
      ASSERT_TRUE(rt->wait_all().ok());
      const std::int64_t pinned = pinned_in_use(*rt);
      const StreamHandle s = rt->compute_stream();
      absl::StatusOr<void*> p = rt->acquire(*h, Tier::kGpu, s);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
      ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());  // kept already: left as it is
      EXPECT_EQ(rt->undo_tensors(), 1u);
      write_on(*dev, s, *p, after);
      ASSERT_TRUE(rt->release(*h, s).ok());
      const RuntimeStats kept = rt->stats();
      EXPECT_EQ(kept.undo_bytes, static_cast<std::int64_t>(kN * 4));
      EXPECT_EQ(kept.undo_copied_bytes, on_gpu ? 0 : static_cast<std::int64_t>(kN * 4));
      // While the log holds it, the tensor cannot go and no step can begin.
      EXPECT_EQ(rt->unregister(*h).code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_EQ(rt->begin_step().code(), absl::StatusCode::kFailedPrecondition);
      ASSERT_TRUE(commit ? rt->commit_undo().ok() : rt->rollback_undo().ok());
      EXPECT_EQ(rt->undo_tensors(), 0u);
      ASSERT_TRUE(rt->wait_all().ok());
      dev->run_pending();
      EXPECT_EQ(read_all(*rt, *h), commit ? after : before);
      EXPECT_EQ(rt->stats().undo_bytes, 0);
      EXPECT_EQ(pinned_in_use(*rt), pinned) << "what was kept was not freed";
      ASSERT_TRUE(rt->begin_step().ok());
      ASSERT_TRUE(rt->end_step().ok());
    }
  }
}

// A layer of one optimizer state for each of `before`, registered from it, and the runtime
// prepared: under layer_prefetch, a staged optimizer step can begin.
std::vector<TensorHandle> register_staged_layers(
    Runtime& rt, const std::vector<std::vector<unsigned char>>& before) {
  std::vector<TensorHandle> hs;
  for (std::size_t layer = 0; layer < before.size(); ++layer) {
    const int l = static_cast<int>(layer);
    absl::StatusOr<TensorHandle> h = rt.register_tensor(
        spec(str_cat("m", l), l, Role::kOptimizerState, kN), before[layer].data());
    EXPECT_TRUE(h.ok()) << h.status();
    if (h.ok()) hs.push_back(*h);
  }
  EXPECT_TRUE(rt.prepare().ok());
  return hs;
}

// Three layers' bytes: pattern(base), pattern(base + 1), pattern(base + 2).
std::vector<std::vector<unsigned char>> layer_patterns(float base) {
  std::vector<std::vector<unsigned char>> out;
  for (int layer = 0; layer < 3; ++layer) out.push_back(pattern(base + static_cast<float>(layer)));
  return out;
}

// An optimizer step over the layers of `hs` (registered by register_staged_layers) as Adam takes
// it in backward: each layer staged, kept for undo, written with `after` on the compute stream and
// released.
void step_staged_layers(Runtime& rt, SimulatedDevice& dev, const std::vector<TensorHandle>& hs,
                        const std::vector<std::vector<unsigned char>>& after) {
  const StreamHandle s = rt.compute_stream();
  ASSERT_TRUE(rt.begin_optimizer_step().ok());
  for (int layer : rt.optimizer_layer_order()) {
    absl::StatusOr<std::vector<void*>> p =
        rt.acquire_layer(layer, RoleSet::optimizer_states(), Tier::kGpu, s);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(rt.keep_for_undo(hs[static_cast<std::size_t>(layer)], s).ok());
    write_on(dev, s, (*p)[0], after[static_cast<std::size_t>(layer)]);
    ASSERT_TRUE(rt.release_layer(layer, RoleSet::optimizer_states(), s).ok());
  }
  ASSERT_TRUE(rt.end_optimizer_step().ok());
}

// A runtime destroyed with an undo still kept (a step taken in backward whose take-back failed, or
// a runtime that goes mid-step) frees what the log kept before its pools go: no pool reports a
// live block, and nothing is freed twice (a second free would stop the process).
TEST(UndoLogTest, ARuntimeDestroyedWithAnUndoKeptFreesIt) {
  for (const bool on_gpu : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "undo on the GPU " << on_gpu);
    PolicyConfig config;
    config.undo_on_gpu = on_gpu;
    auto [rt, dev] = make_runtime("keep_on_gpu", config, /*deferred=*/false);
    const std::vector<unsigned char> before = pattern(2.0f);
    absl::StatusOr<TensorHandle> h =
        rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
    ASSERT_TRUE(h.ok()) << h.status();
    const StreamHandle s = rt->compute_stream();
    ASSERT_TRUE(rt->acquire(*h, Tier::kGpu, s).ok());
    ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
    ASSERT_TRUE(rt->release(*h, s).ok());
    ASSERT_EQ(rt->undo_tensors(), 1u);
    EXPECT_EQ(rt->stats().undo_copied_bytes, on_gpu ? 0 : static_cast<std::int64_t>(kN * 4));
    ::testing::internal::CaptureStderr();
    rt.reset();
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(said.find("live block"), std::string::npos) << said;
  }
  // Staged tensors, kept by their old home blocks: the last layer's write-back not yet queued when
  // the runtime goes (its fresh block unused), the others' queued into fresh blocks, copies
  // pending.
  for (const bool step_ended : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "step ended " << step_ended);
    auto [rt, dev] =
        make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::optimizer_states()},
                     /*deferred=*/true);
    const std::vector<std::vector<unsigned char>> before = {pattern(0.0f), pattern(1.0f),
                                                            pattern(2.0f)};
    const std::vector<TensorHandle> hs = register_staged_layers(*rt, before);
    ASSERT_EQ(hs.size(), before.size());
    const StreamHandle s = rt->compute_stream();
    ASSERT_TRUE(rt->begin_optimizer_step().ok());
    const std::vector<int> order = rt->optimizer_layer_order();
    for (std::size_t i = 0; i < order.size(); ++i) {
      const int layer = order[i];
      ASSERT_TRUE(rt->acquire_layer(layer, RoleSet::optimizer_states(), Tier::kGpu, s).ok());
      ASSERT_TRUE(rt->keep_for_undo(hs[static_cast<std::size_t>(layer)], s).ok());
      if (!step_ended && i + 1 == order.size()) break;  // still held and staged
      ASSERT_TRUE(rt->release_layer(layer, RoleSet::optimizer_states(), s).ok());
    }
    if (step_ended) {
      ASSERT_TRUE(rt->end_optimizer_step().ok());
    }
    ASSERT_EQ(rt->undo_tensors(), 3u);
    ::testing::internal::CaptureStderr();
    rt.reset();
    const std::string said = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(said.find("live block"), std::string::npos) << said;
  }
}

// A staged tensor (layer_prefetch's states in an optimizer step) is kept with no copy: its
// write-back goes to a fresh home block. Rolled back, the old block is home again with the old
// bytes; committed, the fresh one with the new bytes.
TEST(UndoLogTest, AStagedTensorKeepsItsOldHomeBlockWithNoCopy) {
  for (const bool commit : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "commit " << commit);
    auto [rt, dev] =
        make_runtime("layer_prefetch", {.prefetch_depth = 1, .roles = RoleSet::optimizer_states()},
                     /*deferred=*/true);
    const std::vector<std::vector<unsigned char>> before = layer_patterns(0.0f);
    const std::vector<std::vector<unsigned char>> after = layer_patterns(10.0f);
    const std::vector<TensorHandle> hs = register_staged_layers(*rt, before);
    ASSERT_EQ(hs.size(), before.size());
    step_staged_layers(*rt, *dev, hs, after);
    EXPECT_EQ(rt->undo_tensors(), 3u);
    EXPECT_EQ(rt->stats().undo_copied_bytes, 0) << "a staged tensor was copied for its undo";
    ASSERT_TRUE(commit ? rt->commit_undo().ok() : rt->rollback_undo().ok());
    ASSERT_TRUE(rt->wait_all().ok());
    dev->run_pending();
    for (std::size_t l = 0; l < hs.size(); ++l) {
      EXPECT_EQ(read_all(*rt, hs[l]), commit ? after[l] : before[l]) << "layer " << l;
      EXPECT_NE(rt->info(hs[l])->tier, Tier::kGpu);  // home again, in pinned memory
    }
    EXPECT_EQ(rt->stats().undo_bytes, 0);
  }
}

// Three layers' states stepped in backward under layer_prefetch on a deferred device (a slot for
// each layer: no fetch waits for a write-back), nothing run yet.
struct SteppedLayers {
  Made made;
  std::vector<TensorHandle> hs;
  std::vector<std::vector<unsigned char>> after = layer_patterns(10.0f);
};
SteppedLayers step_three_layers() {
  SteppedLayers s{make_runtime("layer_prefetch",
                               {.prefetch_depth = 3, .roles = RoleSet::optimizer_states()},
                               /*deferred=*/true)};
  s.hs = register_staged_layers(*s.made.rt, layer_patterns(0.0f));
  EXPECT_EQ(s.hs.size(), 3u);
  step_staged_layers(*s.made.rt, *s.made.device, s.hs, s.after);
  return s;
}

// The pinned blocks the next step takes for its write-backs (an allocation reclaims the freed
// blocks whose streams have passed), written at once.
std::vector<void*> take_next_blocks(Runtime& rt, std::size_t n) {
  std::vector<void*> next;
  for (std::size_t l = 0; l < n; ++l) {
    absl::StatusOr<void*> b = rt.allocator().allocate(Tier::kPinnedHost, kN * sizeof(float), {});
    EXPECT_TRUE(b.ok()) << b.status();
    if (!b.ok()) continue;
    std::memset(*b, 0xAB, kN * sizeof(float));
    next.push_back(*b);
  }
  return next;
}

// Runs everything; each layer holds the step's bytes and no write-back landed in `next`, which
// goes back to the pool.
void expect_written_back_apart(SteppedLayers& s, const std::vector<void*>& next) {
  ASSERT_TRUE(s.made.rt->wait_all().ok());
  s.made.device->run_pending();
  for (std::size_t l = 0; l < s.hs.size(); ++l) {
    EXPECT_EQ(read_all(*s.made.rt, s.hs[l]), s.after[l]) << "layer " << l;
  }
  for (void* b : next) {
    const auto* bytes = static_cast<const unsigned char*>(b);
    EXPECT_TRUE(std::all_of(bytes, bytes + kN * sizeof(float), [](unsigned char c) {
      return c == 0xAB;
    })) << "a write-back landed in a reused block";
    ASSERT_TRUE(s.made.rt->allocator().deallocate(Tier::kPinnedHost, b).ok());
  }
}

// Committed before the fetches that read them ran, the old home blocks are not reused until they
// have.
TEST(UndoLogTest, ACommittedOldHomeBlockWaitsForTheFetchThatReadIt) {
  SteppedLayers s = step_three_layers();
  Runtime& rt = *s.made.rt;
  ASSERT_TRUE(rt.commit_undo().ok());
  const std::int64_t kept_bytes = static_cast<std::int64_t>(s.hs.size() * kN * sizeof(float));
  std::vector<void*> next = take_next_blocks(rt, s.hs.size());
  EXPECT_EQ(rt.allocator().stats(Tier::kPinnedHost).pending_free_bytes.current, kept_bytes)
      << "an old home block was reused before the fetch that reads it ran";
  expect_written_back_apart(s, next);
}

// After a commit, an old home block waits only for the fetch that read it (its last use, marked
// when it was kept; See Note [Last use] in allocator/block_pool.h): not for the write-backs still
// running on the D2H stream, nor for H2D work queued since (the next step's fetches, with the host
// ahead of the GPU). So the next step's fresh blocks reuse the old ones, and the pinned pool does
// not grow from step to step.
TEST(UndoLogTest, ACommittedOldHomeBlockWaitsOnlyForTheFetchThatReadIt) {
  SteppedLayers s = step_three_layers();
  Runtime& rt = *s.made.rt;
  SimulatedDevice& dev = *s.made.device;
  // The fetches and the kernels ran; the write-backs have not.
  while (dev.run_one(rt.h2d_stream()) || dev.run_one(rt.compute_stream())) {
  }
  ASSERT_GT(dev.pending_copies(), 0);
  // A later fetch, queued and not run.
  std::vector<unsigned char> src(kN * sizeof(float), 1), dst(kN * sizeof(float));
  ASSERT_TRUE(dev.copy_async(dst.data(), src.data(), src.size(), rt.h2d_stream()).ok());
  const alloc::TierStats before = rt.allocator().stats(Tier::kPinnedHost);
  ASSERT_TRUE(rt.commit_undo().ok());
  std::vector<void*> next = take_next_blocks(rt, s.hs.size());
  const alloc::TierStats now = rt.allocator().stats(Tier::kPinnedHost);
  EXPECT_EQ(now.reserved_bytes.current, before.reserved_bytes.current)
      << "the pinned pool grew: an old home block waited for work queued after its fetch";
  EXPECT_EQ(now.pending_free_bytes.current, 0);
  expect_written_back_apart(s, next);
  EXPECT_EQ(dst, src);
}

// Refusals: a tensor not held on the GPU, a rollback while a kept tensor is held, and, with
// over_link false and no room on the GPU, nothing kept at all.
TEST(UndoLogTest, RefusalsKeepNothingAndChangeNothing) {
  auto [rt, dev] = make_runtime("keep_on_gpu");
  const std::vector<unsigned char> before = pattern(2.0f), after = pattern(7.0f);
  absl::StatusOr<TensorHandle> h =
      rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
  ASSERT_TRUE(h.ok()) << h.status();
  const StreamHandle s = rt->compute_stream();
  EXPECT_EQ(rt->keep_for_undo(*h, s).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->undo_tensors(), 0u);

  absl::StatusOr<void*> p = rt->acquire(*h, Tier::kGpu, s);
  ASSERT_TRUE(p.ok()) << p.status();
  // undo_on_gpu is off: a tensor resting on the GPU can only be kept over the link.
  const absl::Status no_link = rt->keep_for_undo(*h, s, /*over_link=*/false);
  EXPECT_EQ(no_link.code(), absl::StatusCode::kResourceExhausted) << no_link;
  EXPECT_EQ(rt->undo_tensors(), 0u);
  EXPECT_EQ(rt->stats().undo_bytes, 0);

  ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
  write_on(*dev, s, *p, after);
  EXPECT_EQ(rt->rollback_undo().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rt->undo_tensors(), 1u) << "a refused rollback dropped what was kept";
  ASSERT_TRUE(rt->release(*h, s).ok());
  ASSERT_TRUE(rt->rollback_undo().ok());
  ASSERT_TRUE(rt->wait_all().ok());
  EXPECT_EQ(read_all(*rt, *h), before);
}

// set_undo_on_gpu moves where the next undo of a resting tensor goes, between steps only and with
// nothing kept; a refusal leaves the setting as it was.
TEST(UndoLogTest, SetUndoOnGpuTakesEffectBetweenStepsOnly) {
  auto [rt, dev] = make_runtime("keep_on_gpu", PolicyConfig{}, /*deferred=*/true);
  const std::vector<unsigned char> before = pattern(4.0f), after = pattern(-1.0f);
  absl::StatusOr<TensorHandle> h =
      rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_FALSE(rt->undo_on_gpu());
  const StreamHandle s = rt->compute_stream();
  auto keep_and_roll_back = [&] {
    absl::StatusOr<void*> p = rt->acquire(*h, Tier::kGpu, s);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
    // With something kept, the setting cannot change under it.
    EXPECT_EQ(rt->set_undo_on_gpu(!rt->undo_on_gpu()).code(),
              absl::StatusCode::kFailedPrecondition);
    write_on(*dev, s, *p, after);
    ASSERT_TRUE(rt->release(*h, s).ok());
    ASSERT_TRUE(rt->rollback_undo().ok());
    ASSERT_TRUE(rt->wait_all().ok());
    dev->run_pending();
    EXPECT_EQ(read_all(*rt, *h), before);
  };
  keep_and_roll_back();
  const std::int64_t copied = rt->stats().undo_copied_bytes;
  EXPECT_EQ(copied, static_cast<std::int64_t>(kN * 4)) << "off: kept over the link";

  ASSERT_TRUE(rt->begin_step().ok());
  EXPECT_EQ(rt->set_undo_on_gpu(true).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(rt->end_step().ok());
  EXPECT_FALSE(rt->undo_on_gpu()) << "a refused call changed the setting";

  ASSERT_TRUE(rt->set_undo_on_gpu(true).ok());
  EXPECT_TRUE(rt->undo_on_gpu());
  keep_and_roll_back();
  EXPECT_EQ(rt->stats().undo_copied_bytes, copied) << "on: kept on the GPU, with no copy off it";
}

// Copies kept on the GPU from an UndoMemory of the framework's (See Note [The undo in the
// framework's memory] in runtime/undo_log.cpp): the block comes from it on the stream that steps,
// goes back to it behind that stream, counts in the GPU budget meanwhile, and nothing of strata's
// GPU pool is used. A framework with no room, or a budget spent, sends the copy to pinned memory
// without asking it.
class FakeUndoMemory final : public UndoMemory {
 public:
  explicit FakeUndoMemory(SimulatedDevice& dev) : dev_(dev) {}
  absl::StatusOr<void*> allocate(std::size_t bytes, StreamHandle stream) override {
    ++asked;
    if (fail) return absl::InternalError("the framework's allocator failed");
    if (full) return nullptr;
    auto block = std::make_unique<std::vector<unsigned char>>(bytes, 0xAB);
    void* ptr = block->data();
    blocks_.emplace(ptr, std::move(block));
    last_stream = stream;
    return ptr;
  }
  absl::Status free(void* ptr, StreamHandle stream) override {
    if (!blocks_.contains(ptr)) return absl::InvalidArgumentError("not mine");
    ++freed;
    freed_stream = stream;
    // As torch's allocator: the block is reusable in the stream's order, not before.
    return dev_.enqueue_host(stream, [this, ptr] { blocks_.erase(ptr); });
  }
  std::size_t live() const { return blocks_.size(); }
  int asked = 0, freed = 0;
  bool full = false, fail = false;
  StreamHandle last_stream = nullptr, freed_stream = nullptr;

 private:
  SimulatedDevice& dev_;
  std::map<void*, std::unique_ptr<std::vector<unsigned char>>> blocks_;
};

TEST(UndoLogTest, CopiesOnTheGpuComeFromTheFrameworksMemory) {
  for (const bool commit : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "commit " << commit);
    PolicyConfig config;
    config.undo_on_gpu = true;
    auto [rt, dev] = make_runtime("keep_on_gpu", config, /*deferred=*/true);
    auto memory = std::make_shared<FakeUndoMemory>(*dev);
    ASSERT_TRUE(rt->set_undo_memory(memory).ok());
    const std::vector<unsigned char> before = pattern(5.0f), after = pattern(-2.0f);
    absl::StatusOr<TensorHandle> h =
        rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(rt->wait_all().ok());
    const alloc::Budget& budget = *rt->allocator().budget(Tier::kGpu);
    const std::size_t reserved = budget.reserved();
    const std::int64_t gpu_allocated = rt->allocator().stats(Tier::kGpu).allocated_bytes.current;
    const StreamHandle s = rt->compute_stream();
    absl::StatusOr<void*> p = rt->acquire(*h, Tier::kGpu, s);
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
    EXPECT_EQ(memory->asked, 1);
    EXPECT_EQ(memory->last_stream, s);
    EXPECT_EQ(budget.reserved(), reserved + kN * 4) << "the copy is not in the budget";
    EXPECT_EQ(rt->allocator().stats(Tier::kGpu).allocated_bytes.current, gpu_allocated)
        << "the copy came from strata's GPU pool";
    // Nothing kept may change where copies come from.
    EXPECT_EQ(rt->set_undo_memory(nullptr).code(), absl::StatusCode::kFailedPrecondition);
    write_on(*dev, s, *p, after);
    ASSERT_TRUE(rt->release(*h, s).ok());
    EXPECT_EQ(rt->stats().undo_copied_bytes, 0);
    ASSERT_TRUE(commit ? rt->commit_undo().ok() : rt->rollback_undo().ok());
    EXPECT_EQ(memory->freed, 1);
    EXPECT_EQ(memory->freed_stream, s);
    EXPECT_EQ(budget.reserved(), reserved);
    ASSERT_TRUE(rt->wait_all().ok());
    dev->run_pending();
    EXPECT_EQ(memory->live(), 0u) << "the block never went back";
    EXPECT_EQ(read_all(*rt, *h), commit ? after : before);

    // No room in the framework: pinned memory, as with the budget spent, where it is not asked.
    for (const bool budget_spent : {false, true}) {
      memory->full = !budget_spent;
      if (budget_spent) {
        ASSERT_TRUE(rt->set_gpu_budget(budget.reserved()).ok());
      }
      const int asked = memory->asked;
      const std::int64_t copied = rt->stats().undo_copied_bytes;
      absl::StatusOr<void*> q = rt->acquire(*h, Tier::kGpu, s);
      ASSERT_TRUE(q.ok()) << q.status();
      ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
      EXPECT_EQ(memory->asked, asked + (budget_spent ? 0 : 1));
      EXPECT_EQ(rt->stats().undo_copied_bytes, copied + static_cast<std::int64_t>(kN * 4));
      ASSERT_TRUE(rt->release(*h, s).ok());
      ASSERT_TRUE(rt->commit_undo().ok());
      EXPECT_EQ(budget.reserved(), reserved);
    }
    ASSERT_TRUE(rt->wait_all().ok());
    dev->run_pending();
  }
}

// A framework's allocator that fails: keep_for_undo says so, keeps nothing and leaves the budget as
// it was. A runtime that goes with a copy still kept gives it back to the framework.
TEST(UndoLogTest, TheFrameworksMemoryFailingOrOutlivedKeepsNothingBehind) {
  PolicyConfig config;
  config.undo_on_gpu = true;
  auto [rt, dev] = make_runtime("keep_on_gpu", config, /*deferred=*/true);
  auto memory = std::make_shared<FakeUndoMemory>(*dev);
  ASSERT_TRUE(rt->set_undo_memory(memory).ok());
  const std::vector<unsigned char> before = pattern(3.0f);
  absl::StatusOr<TensorHandle> h =
      rt->register_tensor(spec("w", 0, Role::kOptimizerState, kN), before.data());
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(rt->wait_all().ok());
  const std::size_t reserved = rt->allocator().budget(Tier::kGpu)->reserved();
  const StreamHandle s = rt->compute_stream();
  ASSERT_TRUE(rt->acquire(*h, Tier::kGpu, s).ok());
  memory->fail = true;
  const absl::Status failed = rt->keep_for_undo(*h, s);
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_EQ(rt->undo_tensors(), 0u);
  EXPECT_EQ(rt->allocator().budget(Tier::kGpu)->reserved(), reserved);
  memory->fail = false;
  ASSERT_TRUE(rt->keep_for_undo(*h, s).ok());
  ASSERT_TRUE(rt->release(*h, s).ok());
  EXPECT_EQ(memory->live(), 1u);
  rt.reset();  // with the copy still kept
  EXPECT_EQ(memory->freed, 1) << "the runtime went and the framework's block never went back";
}

}  // namespace
}  // namespace strata::rt
