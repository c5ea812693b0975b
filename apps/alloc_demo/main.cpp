// strata-alloc-demo: the allocator on its own (strata-train, what `make demo` runs, shows it
// inside training). It plays one layer-by-layer optimizer step's allocations through the tiered
// allocator (optimizer states resident in pinned host memory, staged through GPU blocks two layers
// at a time, activations and temporaries on the GPU, a checkpoint buffer in pageable memory) and
// prints per-tier stats, the fragmentation figure and the leak report. On a machine without a GPU
// the GPU tier is the simulated device.
//
//   build/bin/strata-alloc-demo [--layers N] [--layer-mib M]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "allocator/tiered_allocator.h"
#include "base/status.h"
#include "base/units.h"

namespace {

using strata::kMiB;
using strata::alloc::Tier;

struct Args {
  int layers = 8;
  std::size_t layer_bytes = 24 * kMiB;
};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--layers" && i + 1 < argc) {
      args.layers = std::atoi(argv[++i]);
    } else if (a == "--layer-mib" && i + 1 < argc) {
      args.layer_bytes = static_cast<std::size_t>(std::atoi(argv[++i])) * kMiB;
    } else {
      std::fprintf(stderr, "usage: %s [--layers N] [--layer-mib M]\n", argv[0]);
      std::exit(2);
    }
  }
  if (args.layers <= 0 || args.layer_bytes == 0) {
    std::fprintf(stderr, "strata-alloc-demo: --layers and --layer-mib must be > 0\n");
    std::exit(2);
  }
  return args;
}

absl::Status run(const Args& args) {
  strata::alloc::AllocatorOptions options;
  options.track_allocations = true;
  options.simulated_device.capacity = 4 * strata::kGiB;
  STRATA_ASSIGN_OR_RETURN(auto allocator,
                          strata::alloc::TieredAllocator::create(std::move(options)));
  std::printf("strata allocator demo: GPU tier is %s (%s); pinned tier: %s; pageable tier: %s\n",
              allocator->gpu_is_simulated() ? "simulated" : "CUDA",
              std::string(allocator->upstream(Tier::kGpu).name()).c_str(),
              std::string(allocator->upstream(Tier::kPinnedHost).name()).c_str(),
              std::string(allocator->upstream(Tier::kPageableHost).name()).c_str());
  std::printf("%d layers, %s of Adam moments each, 2 layers staged on the GPU at a time\n\n",
              args.layers, strata::format_bytes(args.layer_bytes).c_str());

  // Optimizer states live in pinned host memory.
  std::vector<void*> states;
  for (int l = 0; l < args.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(
        void* s, allocator->allocate(Tier::kPinnedHost, args.layer_bytes,
                                     {.owner = strata::str_cat("layer", l, ".moments")}));
    std::memset(s, l, args.layer_bytes);
    states.push_back(s);
  }
  // Three steps: each stages layer by layer through two GPU slots and allocates temporaries.
  for (int step = 0; step < 3; ++step) {
    std::vector<void*> staged;
    for (int l = 0; l < args.layers; ++l) {
      STRATA_ASSIGN_OR_RETURN(
          void* slot, allocator->allocate(Tier::kGpu, args.layer_bytes, {.owner = "staging"}));
      STRATA_ASSIGN_OR_RETURN(void* temp, allocator->allocate(Tier::kGpu, args.layer_bytes / 7 + 3,
                                                              {.owner = "adam.temp"}));
      STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kGpu, temp));
      staged.push_back(slot);
      if (staged.size() > 2) {
        STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kGpu, staged.front()));
        staged.erase(staged.begin());
      }
    }
    for (void* slot : staged) STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kGpu, slot));
  }
  STRATA_ASSIGN_OR_RETURN(
      void* checkpoint,
      allocator->allocate(Tier::kPageableHost, args.layer_bytes, {.owner = "checkpoint.buffer"}));
  std::memcpy(checkpoint, states[0], args.layer_bytes);

  std::printf("per-tier stats with the states live:\n%s\n", allocator->format_stats().c_str());
  std::printf("%s\n", allocator->format_leak_report().c_str());

  STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kPageableHost, checkpoint));
  for (void* s : states) STRATA_RETURN_IF_ERROR(allocator->deallocate(Tier::kPinnedHost, s));
  STRATA_ASSIGN_OR_RETURN(std::size_t trimmed, allocator->trim_all());
  std::printf("after freeing everything and trimming (%s returned to the upstreams):\n%s\n",
              strata::format_bytes(trimmed).c_str(), allocator->format_stats().c_str());
  std::printf("%s", allocator->format_leak_report().c_str());
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::Status status = run(parse_args(argc, argv));
  if (!status.ok()) {
    std::fprintf(stderr, "strata-alloc-demo: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
