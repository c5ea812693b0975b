#include "allocator/tiered_allocator.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>

#include "base/status.h"
#include "base/strings.h"
#include "base/units.h"

namespace strata::alloc {

std::string_view device_backend_name(DeviceBackend backend) {
  switch (backend) {
    case DeviceBackend::kAuto:
      return "auto";
    case DeviceBackend::kCuda:
      return "cuda";
    case DeviceBackend::kSimulated:
      return "simulated";
  }
  return "unknown";
}

std::string_view gpu_segments_name(GpuSegments segments) {
  switch (segments) {
    case GpuSegments::kAuto:
      return "auto";
    case GpuSegments::kExpandable:
      return "expandable";
    case GpuSegments::kFixed:
      return "fixed";
  }
  return "unknown";
}

absl::StatusOr<GpuSegments> parse_gpu_segments(std::string_view name) {
  if (name == "auto") return GpuSegments::kAuto;
  if (name == "expandable") return GpuSegments::kExpandable;
  if (name == "fixed") return GpuSegments::kFixed;
  return absl::InvalidArgumentError(str_cat("must be auto, expandable or fixed, not '", name, "'"));
}

namespace {

// kAuto resolved: the environment's choice, else expandable.
absl::StatusOr<bool> want_expandable(GpuSegments segments) {
  if (segments == GpuSegments::kAuto) {
    const char* env = std::getenv("STRATA_GPU_SEGMENTS");
    if (env == nullptr || *env == '\0') return true;
    absl::StatusOr<GpuSegments> parsed = parse_gpu_segments(env);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(str_cat("STRATA_GPU_SEGMENTS ", parsed.status().message()));
    }
    segments = *parsed;
  }
  return segments != GpuSegments::kFixed;
}

// MemTotal and MemAvailable from /proc/meminfo, in bytes; nullopt where they cannot be read.
struct HostMemory {
  std::size_t total = 0;
  std::size_t available = 0;
};
std::optional<HostMemory> read_host_memory() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return std::nullopt;
  HostMemory m;
  char key[64];
  unsigned long long kib = 0;
  while (std::fscanf(f, "%63s %llu kB", key, &kib) == 2) {
    if (std::strcmp(key, "MemTotal:") == 0) m.total = static_cast<std::size_t>(kib) * 1024;
    if (std::strcmp(key, "MemAvailable:") == 0) m.available = static_cast<std::size_t>(kib) * 1024;
  }
  std::fclose(f);
  if (m.total == 0 || m.available == 0) return std::nullopt;
  return m;
}

// The default budget of a host tier, and what an out-of-memory message says of it
// (See Note [Host budgets] in tiered_allocator.h).
std::pair<std::size_t, std::string> machine_budget(Tier tier) {
  const std::optional<HostMemory> m = read_host_memory();
  if (!m.has_value()) return {kNoBudget, ""};
  const std::string set = "; AllocatorOptions::budgets sets another";
  if (tier == Tier::kPinnedHost) {
    return {std::min(m->total / 2, m->available),
            str_cat(" (the default for pinned memory: half of the machine's ",
                    format_bytes(m->total), ", at most the ", format_bytes(m->available),
                    " available when the allocator was made", set, ")")};
  }
  return {m->available,
          str_cat(" (the default for pageable memory: the ", format_bytes(m->available),
                  " the machine had available when the allocator was made", set, ")")};
}

}  // namespace

absl::StatusOr<std::unique_ptr<TieredAllocator>> TieredAllocator::create(AllocatorOptions options) {
  std::array<std::string, kNumTiers> notes;
  for (Tier tier : kAllTiers) {
    std::size_t& budget = options.budgets[tier_index(tier)];
    if (budget != kMachineBudget) continue;
    if (tier == Tier::kGpu || options.upstreams[tier_index(tier)] != nullptr) {
      budget = kNoBudget;  // an upstream of the caller's is not the machine's memory
    } else {
      std::tie(budget, notes[tier_index(tier)]) = machine_budget(tier);
    }
  }
  for (Tier tier : kAllTiers) {
    const int i = tier_index(tier);
    if (options.budgets[i] == 0) {
      return absl::InvalidArgumentError(
          str_cat("budget of tier ", tier_name(tier), " is 0; use kNoBudget for none"));
    }
    if (options.initial_reservation[i] > options.budgets[i]) {
      return absl::InvalidArgumentError(str_cat("initial reservation of tier ", tier_name(tier),
                                                " (", format_bytes(options.initial_reservation[i]),
                                                ") is above its budget (",
                                                format_bytes(options.budgets[i]), ")"));
    }
  }
  if (options.simulated_device.capacity == 0) {
    return absl::InvalidArgumentError("simulated device capacity is 0");
  }

  bool use_cuda = false;
  switch (options.device) {
    case DeviceBackend::kAuto:
      use_cuda = cuda_device_count() > 0;
      break;
    case DeviceBackend::kCuda:
      if (cuda_device_count() == 0) {
        return absl::UnavailableError(
            "device backend 'cuda' was asked for but no CUDA device is visible (built with CUDA: "
#ifdef STRATA_HAS_CUDA
            "yes)"
#else
            "no)"
#endif
        );
      }
      use_cuda = true;
      break;
    case DeviceBackend::kSimulated:
      use_cuda = false;
      break;
  }

  std::unique_ptr<TieredAllocator> self(new TieredAllocator());
  self->gpu_simulated_ = !use_cuda;
  self->track_allocations_ = options.track_allocations;
  if (options.stream_ops != nullptr) {
    self->stream_ops_ = options.stream_ops;
  } else if (use_cuda) {
    STRATA_ASSIGN_OR_RETURN(self->stream_ops_, make_cuda_stream_ops(options.cuda_device));
  } else {
    self->stream_ops_ = std::make_shared<SimulatedStreamOps>();
  }

  STRATA_ASSIGN_OR_RETURN(const bool expandable, want_expandable(options.gpu_segments));
  for (Tier tier : kAllTiers) {
    const int i = tier_index(tier);
    std::unique_ptr<Upstream> upstream = std::move(options.upstreams[i]);
    if (upstream == nullptr) {
      switch (tier) {
        case Tier::kGpu:
          if (use_cuda) {
            STRATA_ASSIGN_OR_RETURN(
                upstream, make_cuda_device_upstream(options.cuda_device, options.device_method));
          } else {
            upstream = make_simulated_device_upstream(options.simulated_device);
          }
          break;
        case Tier::kPinnedHost:
          if (use_cuda) {
            STRATA_ASSIGN_OR_RETURN(
                upstream, make_pinned_host_upstream(options.pinned_method, options.cuda_device));
          } else {
            upstream = make_simulated_pinned_upstream();
          }
          break;
        case Tier::kPageableHost:
          upstream = make_pageable_host_upstream();
          break;
      }
    }
    self->pools_[i] =
        std::make_unique<BlockPool>(PoolConfig{.tier = tier,
                                               .budget = options.budgets[i],
                                               .track_allocations = options.track_allocations,
                                               .shared_budget = nullptr,
                                               .budget_note = notes[i],
                                               .expandable = tier == Tier::kGpu && expandable},
                                    std::move(upstream), self->stream_ops_);
  }

  for (Tier tier : kAllTiers) {
    const std::size_t bytes = options.initial_reservation[tier_index(tier)];
    if (bytes == 0) continue;
    BlockPool& pool = self->pool(tier);
    absl::StatusOr<void*> seed = pool.allocate(bytes, {.owner = "initial_reservation"});
    if (!seed.ok()) {
      return absl::Status(seed.status().code(),
                          str_cat("initial reservation failed: ", seed.status().message()));
    }
    STRATA_RETURN_IF_ERROR(pool.deallocate(*seed));
  }
  return self;
}

absl::StatusOr<void*> TieredAllocator::allocate(Tier tier, std::size_t bytes,
                                                const AllocOptions& options) {
  return pools_[tier_index(tier)]->allocate(bytes, options);
}

absl::Status TieredAllocator::deallocate(Tier tier, void* ptr) {
  absl::Status status = pools_[tier_index(tier)]->deallocate(ptr);
  if (status.ok() || status.code() == absl::StatusCode::kInternal) return status;
  // Slow path, for the message only: is it live (or inside a segment) of another tier?
  for (Tier other : kAllTiers) {
    if (other == tier) continue;
    if (pools_[tier_index(other)]->is_live(ptr)) {
      return absl::InvalidArgumentError(str_cat("deallocate in tier ", tier_name(tier), ": ", ptr,
                                                " belongs to tier ", tier_name(other), ", not ",
                                                tier_name(tier)));
    }
  }
  return status;
}

absl::Status TieredAllocator::record_stream(Tier tier, void* ptr, StreamHandle stream) {
  return pools_[tier_index(tier)]->record_stream(ptr, stream);
}

absl::Status TieredAllocator::mark_last_use(Tier tier, void* ptr, StreamHandle stream) {
  return pools_[tier_index(tier)]->mark_last_use(ptr, stream);
}

absl::Status TieredAllocator::synchronize_pending() {
  absl::Status status;
  for (auto& pool : pools_) status.Update(pool->synchronize_pending());
  return status;
}

absl::StatusOr<std::size_t> TieredAllocator::trim(Tier tier) {
  return pools_[tier_index(tier)]->trim();
}

absl::StatusOr<std::size_t> TieredAllocator::trim_all() {
  std::size_t total = 0;
  for (auto& pool : pools_) {
    STRATA_ASSIGN_OR_RETURN(std::size_t bytes, pool->trim());
    total += bytes;
  }
  return total;
}

absl::Status TieredAllocator::set_budget(Tier tier, std::size_t budget) {
  return pools_[tier_index(tier)]->set_budget(budget);
}

TierStats TieredAllocator::stats(Tier tier) const { return pools_[tier_index(tier)]->stats(); }

void TieredAllocator::reset_peak_stats() {
  for (auto& pool : pools_) {
    pool->reset_peak_stats();
    pool->budget_account()->reset_peak();
  }
}

std::vector<LiveAllocation> TieredAllocator::leak_report() const {
  std::vector<LiveAllocation> out;
  for (const auto& pool : pools_) {
    std::vector<LiveAllocation> live = pool->live_allocations();
    out.insert(out.end(), std::make_move_iterator(live.begin()),
               std::make_move_iterator(live.end()));
  }
  return out;
}

std::string TieredAllocator::format_leak_report() const {
  std::vector<LiveAllocation> live = leak_report();
  if (live.empty()) return "leak report: no live allocations\n";
  std::size_t bytes = 0;
  for (const LiveAllocation& a : live) bytes += a.size;
  std::string out =
      str_cat("leak report: ", live.size(), " live allocation(s), ", format_bytes(bytes), "\n");
  for (const LiveAllocation& a : live) {
    str_append(&out, "  ", tier_name(a.tier), " ", a.ptr, " ", format_bytes(a.size), " (",
               a.requested, " B asked) #", a.sequence, " owner=",
               a.owner.empty() ? (track_allocations_ ? "<none>" : "<tracking off>") : a.owner,
               "\n");
  }
  return out;
}

std::string TieredAllocator::format_stats() const {
  std::array<TierStats, kNumTiers> all;
  for (Tier tier : kAllTiers) all[tier_index(tier)] = stats(tier);
  char line[256];
  std::snprintf(line, sizeof(line), "%-22s %22s %22s %22s\n", "stat", "gpu", "pinned_host",
                "pageable_host");
  std::string out = line;
  std::vector<std::array<std::string, kNumTiers>> cells;
  std::vector<std::string> names;
  for (Tier tier : kAllTiers) {
    int row = 0;
    all[tier_index(tier)].for_each(
        [&](std::string_view name, StatKind kind, std::int64_t current, std::int64_t peak) {
          if (static_cast<int>(cells.size()) <= row) {
            cells.emplace_back();
            names.emplace_back(name);
          }
          const bool is_bytes =
              name.find("bytes") != std::string_view::npos || name == "largest_free_block";
          auto show = [&](std::int64_t v) {
            return is_bytes ? format_bytes(static_cast<std::size_t>(v)) : str_cat(v);
          };
          cells[row][tier_index(tier)] =
              kind == StatKind::kGauge ? str_cat(show(current), " / ", show(peak)) : show(current);
          ++row;
        });
  }
  for (std::size_t r = 0; r < cells.size(); ++r) {
    std::snprintf(line, sizeof(line), "%-22s %22s %22s %22s\n", names[r].c_str(),
                  cells[r][0].c_str(), cells[r][1].c_str(), cells[r][2].c_str());
    out += line;
  }
  std::snprintf(line, sizeof(line), "%-22s %22.3f %22.3f %22.3f\n", "fragmentation",
                all[0].fragmentation, all[1].fragmentation, all[2].fragmentation);
  out += line;
  out += "(gauges: current / peak)\n";
  return out;
}

std::string TieredAllocator::stats_json() const {
  std::string out = "{";
  for (Tier tier : kAllTiers) {
    str_append(&out, tier == Tier::kGpu ? "" : ", ", "\"", tier_name(tier),
               "\": ", stats_to_json(stats(tier)));
  }
  return out + "}";
}

}  // namespace strata::alloc
