// optim/adam_checkpoint.cpp: Adam::save and Adam::load, and a parameter's states as float32 values
// for torch's state dict (read_state_values, write_state_values).
//
// Checkpoints are files users download and share, so load trusts nothing in them
// (See Note [Untrusted checkpoints]).
//
// Format (little-endian, as the machine writes it):
//   "STRATA-ADAM-5\n", u8 state dtype (how the moments are stored: 0 float32, 1 bfloat16, 2 int8,
//   as the bytes that follow hold them: See Note [Compressed moments] in state_codec.h), u32
//   groups, per group {i64 step, f64 lr, beta1, beta2, eps, weight_decay, u8 decoupled, amsgrad,
//   maximize}, u32 parameters, per parameter in the optimizer's order {i64 step} (See Note
//   [Per-parameter steps] in adam.h; the group's step is the most of its parameters'), u32 tensors,
//   per tensor (a float32 parameter's master left out: See Note [Float32 masters follow the split]
//   in adam_placement.cpp) {u32 name length, name, u64 bytes, bytes}, u64 FNV-1a of everything
//   before it.
// Version 4 ("STRATA-ADAM-4\n") had no state dtype: its moments are float32.
// Version 3 ("STRATA-ADAM-3\n") had no per-parameter steps: each parameter takes its group's.
// Version 2 ("STRATA-ADAM-2\n") stored the hyperparameters as f32, and version 1
// ("STRATA-ADAM-1\n") as the 24 raw bytes of the float32 AdamHyper of its day (the f32 fields, the
// flags, one byte of padding); load reads all three.
#include <cstring>
#include <istream>
#include <map>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/strings.h"
#include "optim/adam.h"

namespace strata::optim {
namespace {

constexpr std::string_view kMagic1 = "STRATA-ADAM-1\n";
constexpr std::string_view kMagic2 = "STRATA-ADAM-2\n";
constexpr std::string_view kMagic3 = "STRATA-ADAM-3\n";
constexpr std::string_view kMagic4 = "STRATA-ADAM-4\n";
constexpr std::string_view kMagic5 = "STRATA-ADAM-5\n";
// Reads grow their buffers in pieces of this size as the bytes arrive, so what a file claims
// costs nothing until it is there.
constexpr std::size_t kReadPiece = 64 * 1024;
constexpr std::uint32_t kMaxNameBytes = 1u << 16;

struct Hasher {
  std::uint64_t h = 1469598103934665603ull;
  void add(const void* data, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
};

class Writer {
 public:
  explicit Writer(std::ostream& out) : out_(out) {}
  void bytes(const void* data, std::size_t n) {
    hash_.add(data, n);
    out_.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  }
  template <typename T>
  void pod(const T& v) {
    bytes(&v, sizeof(T));
  }
  std::uint64_t hash() const { return hash_.h; }

 private:
  std::ostream& out_;
  Hasher hash_;
};

class Reader {
 public:
  explicit Reader(std::istream& in) : in_(in) {}
  bool bytes(void* data, std::size_t n) {
    in_.read(static_cast<char*>(data), static_cast<std::streamsize>(n));
    if (static_cast<std::size_t>(in_.gcount()) != n) return false;
    hash_.add(data, n);
    return true;
  }
  template <typename T>
  bool pod(T& v) {
    return bytes(&v, sizeof(T));
  }
  // n bytes into out, which grows only as they arrive.
  template <typename Buffer>
  bool grow(Buffer& out, std::size_t n) {
    out.clear();
    while (out.size() < n) {
      const std::size_t have = out.size();
      const std::size_t piece = std::min(kReadPiece, n - have);
      out.resize(have + piece);
      if (!bytes(out.data() + have, piece)) return false;
    }
    return true;
  }
  std::uint64_t hash() const { return hash_.h; }

 private:
  std::istream& in_;
  Hasher hash_;
};

absl::Status truncated() {
  return absl::DataLossError("Adam checkpoint is truncated or not a strata Adam checkpoint");
}

absl::Status corrupt(std::string_view what) {
  return absl::DataLossError(str_cat("Adam checkpoint is corrupt: ", what));
}

bool read_hyper(Reader& r, int version, AdamHyper& h, bool& bools_ok) {
  double f[5];
  unsigned char flags[3];
  if (version >= 3) {
    if (!r.bytes(f, sizeof(f)) || !r.bytes(flags, sizeof(flags))) return false;
  } else {
    unsigned char raw[24];
    if (!r.bytes(raw, version == 1 ? 24 : 23)) return false;
    float narrow[5];
    std::memcpy(narrow, raw, sizeof(narrow));
    for (int i = 0; i < 5; ++i) f[i] = narrow[i];
    std::memcpy(flags, raw + sizeof(narrow), sizeof(flags));
  }
  h.lr = f[0];
  h.beta1 = f[1];
  h.beta2 = f[2];
  h.eps = f[3];
  h.weight_decay = f[4];
  bools_ok = flags[0] <= 1 && flags[1] <= 1 && flags[2] <= 1;
  h.decoupled = flags[0] == 1;
  h.amsgrad = flags[1] == 1;
  h.maximize = flags[2] == 1;
  return true;
}

}  // namespace

absl::Status Adam::save(std::ostream& out) {
  host_speculation_.wait_for_host_steps();
  Writer w(out);
  w.bytes(kMagic5.data(), kMagic5.size());
  w.pod(static_cast<std::uint8_t>(options_.state_dtype));
  w.pod(static_cast<std::uint32_t>(groups_.size()));
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const AdamHyper& h = groups_[g].hyper;
    w.pod(step_count(g));
    for (double f : {h.lr, h.beta1, h.beta2, h.eps, h.weight_decay}) w.pod(f);
    for (bool b : {h.decoupled, h.amsgrad, h.maximize}) w.pod(static_cast<std::uint8_t>(b));
  }
  w.pod(static_cast<std::uint32_t>(slots_.size()));
  if (skips_possible_) {
    STRATA_RETURN_IF_ERROR(runtime_.device().stream_synchronize(runtime_.compute_stream()));
  }
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    w.pod(slots_[i].steps - (skips_possible_ ? skipped_[i] : 0));
  }
  std::vector<rt::TensorHandle> tensors;
  for (const Slot& s : slots_) {
    for (rt::TensorHandle h : s.states()) {
      if (h.valid() && !s.float32_master(h)) tensors.push_back(h);
    }
  }
  w.pod(static_cast<std::uint32_t>(tensors.size()));
  std::vector<unsigned char> buffer;
  for (rt::TensorHandle h : tensors) {
    absl::StatusOr<rt::TensorInfo> info = runtime_.info(h);
    if (!info.ok()) {
      return absl::FailedPreconditionError(str_cat("Adam checkpoint: a state of parameter '",
                                                   name_of_state(h),
                                                   "' was unregistered after the optimizer was "
                                                   "made; nothing to save"));
    }
    w.pod(static_cast<std::uint32_t>(info->spec.name.size()));
    w.bytes(info->spec.name.data(), info->spec.name.size());
    w.pod(static_cast<std::uint64_t>(info->bytes));
    buffer.resize(info->bytes);
    STRATA_RETURN_IF_ERROR(runtime_.read(h, buffer.data()));  // from its tier, to host memory
    w.bytes(buffer.data(), buffer.size());
  }
  const std::uint64_t sum = w.hash();
  out.write(reinterpret_cast<const char*>(&sum), sizeof(sum));
  if (!out) return absl::InternalError("Adam checkpoint: writing failed");
  return absl::OkStatus();
}

// Note [Untrusted checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// load reads and checks the whole checkpoint before it changes anything, and then either loads all
// of it or nothing:
//   - every size and count is checked against this optimizer before anything is allocated for it,
//     and reads grow their buffers only as bytes arrive, so no allocation is larger than the input
//     that has been read (plus one piece);
//   - the states it names must be exactly this optimizer's states, each once, each of the size
//     registered (a checkpoint cannot write a parameter, or any tensor that is not one of them);
//   - hyperparameters must be ones torch would accept, the flags 0 or 1, and amsgrad as the
//     optimizer's (its states differ); step counters must not be negative; the checksum must match;
//   - the states' current values are kept and written back if a write fails part way.
// Bytes after the checksum are not read: a checkpoint may be followed by other data in the stream.
// Longer than a screen on purpose: it reads the format in the order it is written, every check
// before the one write-back.
absl::Status Adam::load(std::istream& in) {
  host_speculation_.wait_for_host_steps();
  // The float32 masters are read from the parameters below: the last host step's copies back are
  // done first.
  STRATA_RETURN_IF_ERROR(sync_host_streams());
  Reader r(in);
  char magic[14];
  static_assert(sizeof(magic) == kMagic5.size() && sizeof(magic) == kMagic4.size() &&
                sizeof(magic) == kMagic3.size() && sizeof(magic) == kMagic2.size() &&
                sizeof(magic) == kMagic1.size());
  if (!r.bytes(magic, sizeof(magic))) return truncated();
  const std::string_view got(magic, sizeof(magic));
  const int version = got == kMagic5   ? 5
                      : got == kMagic4 ? 4
                      : got == kMagic3 ? 3
                      : got == kMagic2 ? 2
                      : got == kMagic1 ? 1
                                       : 0;
  if (version == 0) return truncated();
  std::uint8_t moments = 0;
  if (version >= 5 && !r.pod(moments)) return truncated();
  if (moments > static_cast<std::uint8_t>(StateType::kI8)) {
    return corrupt(str_cat("state dtype ", static_cast<int>(moments), " is none strata knows"));
  }
  if (moments != static_cast<std::uint8_t>(options_.state_dtype)) {
    return absl::InvalidArgumentError(
        str_cat("Adam checkpoint holds ", state_dtype_name(static_cast<StateType>(moments)),
                " moments; this optimizer stores them as ", state_dtype_name(options_.state_dtype),
                ": make it with state_dtype ", state_dtype_name(static_cast<StateType>(moments)),
                " to resume, or load a state dict in torch's format, which converts"));
  }
  std::uint32_t groups = 0;
  if (!r.pod(groups)) return truncated();
  if (groups != groups_.size()) {
    return absl::InvalidArgumentError(str_cat(
        "Adam checkpoint has ", groups, " parameter groups; this optimizer has ", groups_.size()));
  }
  std::vector<std::int64_t> steps(groups);
  std::vector<AdamHyper> hypers(groups);
  for (std::uint32_t g = 0; g < groups; ++g) {
    bool bools_ok = false;
    if (!r.pod(steps[g]) || !read_hyper(r, version, hypers[g], bools_ok)) return truncated();
    if (steps[g] < 0) return corrupt(str_cat("group ", g, " has a negative step counter"));
    if (!bools_ok) return corrupt(str_cat("group ", g, " has a flag that is neither 0 nor 1"));
    if (absl::Status s = check_hyper(hypers[g], g); !s.ok()) {
      return absl::InvalidArgumentError(str_cat("Adam checkpoint: ", s.message()));
    }
    if (hypers[g].amsgrad != groups_[g].hyper.amsgrad) {
      return absl::InvalidArgumentError(
          str_cat("Adam checkpoint: group ", g, " was saved with amsgrad ",
                  hypers[g].amsgrad ? "on" : "off", "; this optimizer has it ",
                  groups_[g].hyper.amsgrad ? "on" : "off"));
    }
  }
  // Each parameter's step: its own (version 4), else its group's.
  std::vector<std::int64_t> slot_steps(slots_.size());
  for (std::size_t i = 0; i < slots_.size(); ++i) slot_steps[i] = steps[slots_[i].group];
  if (version >= 4) {
    std::uint32_t params = 0;
    if (!r.pod(params)) return truncated();
    if (params != slots_.size()) {
      return absl::InvalidArgumentError(str_cat("Adam checkpoint has ", params,
                                                " parameters; this optimizer has ", slots_.size()));
    }
    for (std::uint32_t i = 0; i < params; ++i) {
      if (!r.pod(slot_steps[i])) return truncated();
      if (slot_steps[i] < 0) return corrupt(str_cat("parameter ", i, " has a negative step"));
    }
  }
  std::size_t states = 0;
  for (const Slot& s : slots_) {
    for (rt::TensorHandle h : s.states()) states += h.valid() && !s.float32_master(h) ? 1 : 0;
  }
  // A checkpoint saved before float32 masters were left out may hold them: each is read and
  // dropped, as load takes the master from the parameter (See Note [Float32 masters follow the
  // split] in adam_placement.cpp).
  std::map<std::string, std::size_t, std::less<>> old_masters;  // name -> bytes
  for (const Slot& s : slots_) {
    if (const std::optional<StateDecl> m = float32_master_decl(s)) {
      old_masters[str_cat(s.param_name, ".", m->suffix)] =
          static_cast<std::size_t>(s.numel) * sizeof(float);
    }
  }
  std::uint32_t count = 0;
  if (!r.pod(count)) return truncated();
  if (count < states || count > states + old_masters.size()) {
    return absl::InvalidArgumentError(
        str_cat("Adam checkpoint has ", count, " state tensors; this optimizer has ", states));
  }
  std::vector<std::pair<rt::TensorHandle, std::vector<unsigned char>>> values;
  std::set<std::uint64_t> seen;
  std::string name;
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint32_t len = 0;
    std::uint64_t bytes = 0;
    if (!r.pod(len)) return truncated();
    if (len > kMaxNameBytes) return corrupt(str_cat("a state name of ", len, " bytes"));
    if (!r.grow(name, len) || !r.pod(bytes)) return truncated();
    if (auto old = old_masters.find(name); old != old_masters.end()) {
      if (bytes != old->second) {
        return absl::InvalidArgumentError(str_cat("Adam checkpoint: master '", name, "' has ",
                                                  bytes, " bytes; here it has ", old->second));
      }
      old_masters.erase(old);  // once at most
      std::vector<unsigned char> dropped;
      if (!r.grow(dropped, bytes)) return truncated();
      continue;
    }
    absl::StatusOr<rt::TensorHandle> h = runtime_.find(name);
    if (!h.ok() || slot_of_state_.count(h->id) == 0 ||
        slots_[slot_of_state_.at(h->id)].float32_master(*h)) {
      return absl::InvalidArgumentError(
          str_cat("Adam checkpoint has state '", name, "', which this optimizer does not"));
    }
    if (!seen.insert(h->id).second) {
      return absl::InvalidArgumentError(str_cat("Adam checkpoint has state '", name, "' twice"));
    }
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(*h));
    if (info.bytes != bytes) {
      return absl::InvalidArgumentError(str_cat("Adam checkpoint: state '", name, "' has ", bytes,
                                                " bytes; here it has ", info.bytes));
    }
    std::vector<unsigned char> data;
    if (!r.grow(data, bytes)) return truncated();
    values.emplace_back(*h, std::move(data));
  }
  if (values.size() != states) {
    return absl::InvalidArgumentError(str_cat("Adam checkpoint has ", values.size(), " of the ",
                                              states, " state tensors of this optimizer"));
  }
  const std::uint64_t expect = r.hash();
  std::uint64_t sum = 0;
  in.read(reinterpret_cast<char*>(&sum), sizeof(sum));
  if (in.gcount() != sizeof(sum)) return truncated();
  if (sum != expect) return absl::DataLossError("Adam checkpoint: checksum mismatch (corrupt)");
  // A checkpoint restored forgets a step committed and not finished (below, once it is loaded):
  // what it still holds is let go first.
  if (overlap_committed_) {
    if (absl::Status d = finish_release(); !d.ok()) {
      return absl::Status(d.code(), str_cat("Adam checkpoint: nothing loaded: ", d.message()));
    }
  }

  // A float32 parameter's master is not in the checkpoint: it is the parameter's value (See Note
  // [Float32 masters follow the split] in adam_placement.cpp).
  for (const Slot& s : slots_) {
    if (!s.float32_master(s.master)) continue;
    std::vector<unsigned char> value(static_cast<std::size_t>(s.numel) * sizeof(float));
    if (absl::Status st = runtime_.read(s.param, value.data()); !st.ok()) {
      return absl::Status(st.code(), str_cat("Adam checkpoint: nothing loaded: ", st.message()));
    }
    values.emplace_back(s.master, std::move(value));
  }
  // All or nothing: the current values are kept, and written back if a write fails part way.
  std::vector<std::vector<unsigned char>> previous(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    previous[i].resize(values[i].second.size());
    if (absl::Status s = runtime_.read(values[i].first, previous[i].data()); !s.ok()) {
      return absl::Status(s.code(), str_cat("Adam checkpoint: nothing loaded: ", s.message()));
    }
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    absl::Status s = runtime_.write(values[i].first, values[i].second.data());
    if (s.ok()) continue;
    absl::Status restored;
    for (std::size_t j = 0; j <= i && restored.ok(); ++j) {
      restored = runtime_.write(values[j].first, previous[j].data());
    }
    if (!restored.ok()) {
      return absl::Status(
          s.code(),
          str_cat("Adam checkpoint: writing a state failed (", s.message(),
                  ") and putting the previous values back failed too (", restored.message(),
                  "): the optimizer state is partly loaded; load again"));
    }
    return absl::Status(s.code(), str_cat("Adam checkpoint: nothing loaded: ", s.message()));
  }
  forget_committed_step();
  STRATA_RETURN_IF_ERROR(reset_skipped());
  for (std::size_t i = 0; i < slots_.size(); ++i) slots_[i].steps = slot_steps[i];
  for (std::uint32_t g = 0; g < groups; ++g) groups_[g].hyper = hypers[g];
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::pair<std::string, std::vector<float>>>> Adam::read_state_values(
    rt::TensorHandle param) const {
  host_speculation_.wait_for_host_steps();
  STRATA_ASSIGN_OR_RETURN(std::size_t index, slot_of(param));
  const Slot& s = slots_[index];
  std::vector<std::pair<std::string, std::vector<float>>> out;
  std::vector<unsigned char> raw;
  for (rt::TensorHandle h : s.states()) {
    if (!h.valid() || s.float32_master(h)) continue;
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(h));
    std::vector<float> values(static_cast<std::size_t>(s.numel));
    if (info.spec.dtype == rt::DType::kFloat32) {
      STRATA_RETURN_IF_ERROR(runtime_.read(h, values.data()));
    } else {  // a compressed moment (See Note [Compressed moments] in state_codec.h)
      raw.resize(info.bytes);
      STRATA_RETURN_IF_ERROR(runtime_.read(h, raw.data()));
      decode_moment(options_.state_dtype, info.spec.state == "exp_avg_sq", raw.data(), s.numel,
                    values.data());
    }
    out.emplace_back(info.spec.state, std::move(values));
  }
  return out;
}

absl::Status Adam::write_state_values(
    rt::TensorHandle param, const std::vector<std::pair<std::string, std::vector<float>>>& values) {
  host_speculation_.wait_for_host_steps();
  STRATA_ASSIGN_OR_RETURN(std::size_t index, slot_of(param));
  const Slot& s = slots_[index];
  // Every name and size first, then the bytes each state will hold.
  std::vector<std::pair<rt::TensorHandle, std::vector<unsigned char>>> writes;
  for (const auto& [name, v] : values) {
    rt::TensorHandle found;
    for (rt::TensorHandle h : s.states()) {
      if (h.valid() && runtime_.info(h)->spec.state == name) found = h;
    }
    if (!found.valid()) {
      return absl::InvalidArgumentError(
          str_cat("Adam: parameter '", s.param_name, "' has no state '", name, "'"));
    }
    if (static_cast<std::int64_t>(v.size()) != s.numel) {
      return absl::InvalidArgumentError(str_cat("Adam: state '", name, "' of ", v.size(),
                                                " elements for parameter '", s.param_name, "' of ",
                                                s.numel));
    }
    STRATA_ASSIGN_OR_RETURN(rt::TensorInfo info, runtime_.info(found));
    std::vector<unsigned char> bytes(info.bytes);
    if (info.spec.dtype == rt::DType::kFloat32) {
      std::memcpy(bytes.data(), v.data(), bytes.size());
    } else {
      encode_moment(options_.state_dtype, name == "exp_avg_sq", v.data(), s.numel, bytes.data());
    }
    writes.emplace_back(found, std::move(bytes));
  }
  // All or nothing, as load: what a failed write changed goes back.
  std::vector<std::vector<unsigned char>> previous(writes.size());
  for (std::size_t i = 0; i < writes.size(); ++i) {
    previous[i].resize(writes[i].second.size());
    STRATA_RETURN_IF_ERROR(runtime_.read(writes[i].first, previous[i].data()));
  }
  for (std::size_t i = 0; i < writes.size(); ++i) {
    absl::Status status = runtime_.write(writes[i].first, writes[i].second.data());
    if (status.ok()) continue;
    for (std::size_t j = 0; j < i; ++j) (void)runtime_.write(writes[j].first, previous[j].data());
    return status;
  }
  return absl::OkStatus();
}

}  // namespace strata::optim
