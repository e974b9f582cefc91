// See caller.h. The paths, and why each is or is not refusable, with the evidence
// (TensorFlow 2.21's source and the over-budget tests): benchmarks/NOTES.md, "Which
// requests can be refused".
#include "cc/tf/caller.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "cc/tfmg/c_api.h"

namespace tfmg_tf {
namespace {

// A frame whose (mangled) name holds `needle` belongs to a path of `kind`. A refusable
// rule counts only near the allocator (within kNearFrames named frames): it names the
// function that checks the allocation itself.
struct rule {
  const char* needle;
  unsigned kind;
  bool refusable;
};

const rule kRules[] = {
    // A constant kernel's tensor, made from its proto (Tensor::FromProto, which returns
    // false when its buffer cannot be allocated): ConstantOp's constructor fails with
    // InvalidArgument "Cannot parse tensor from proto" and the function is not built
    // (MemGuardCallback turns that into its out-of-memory error); in constant folding,
    // that node is not folded (GraphOptimizer ignores ConstantFold's error). Other callers
    // of FromProto are not refused: graph construction's shape inference turns the failure
    // into Python's ValueError "Unable to evaluate a constant node".
    {"10ConstantOpC", TFMG_KIND_CONSTANT, true},
    // tf.data's batching checks IsInitialized() and returns ResourceExhausted
    // ("Failed to allocate memory for the batch of component ...").
    {"4data9CopyBatch", TFMG_KIND_DATA, true},
    {"21EnsureOutputAllocated", TFMG_KIND_DATA, true},
    // Context: what the memory is for. None of these callers checks for a null.
    {"TF_NewTensor", TFMG_KIND_INPUT, false},
    {"TF_AllocateTensor", TFMG_KIND_INPUT, false},
    {"NdarrayToTensor", TFMG_KIND_INPUT, false},
    {"12EagerContext12CreateTensor", TFMG_KIND_INPUT, false},
    {"_ZN10tensorflow4data", TFMG_KIND_DATA, false},
    {"_ZN15stream_executor18TfAllocatorAdapter", TFMG_KIND_XLA, false},
    {"_ZN3xla", TFMG_KIND_XLA, false},
    {"ConstantFold", TFMG_KIND_CONSTANT, false},
    {"11GraphRunner", TFMG_KIND_CONSTANT, false},
    {"_ZN10tensorflow8grappler", TFMG_KIND_CONSTANT, false},
    {"6tensor8DeepCopy", TFMG_KIND_COPY, false},
};
constexpr int kNoRule = -1;
constexpr int kNearFrames = 4;   // named frames above the allocator a refusable rule may be at
constexpr int kMaxFrames = 40;

// Where several frames name a path, the one that says most about who holds the memory:
// a tf.data pipeline over a deep copy, say, is tf.data's.
int priority(unsigned kind) {
  switch (kind) {
    case TFMG_KIND_DATA: return 5;
    case TFMG_KIND_XLA: return 4;
    case TFMG_KIND_INPUT: return 3;
    case TFMG_KIND_CONSTANT: return 2;
    case TFMG_KIND_COPY: return 1;
    default: return 0;
  }
}

struct frame_class {
  bool named = false;
  bool onednn = false;
  bool leaks = false;
  int rule = kNoRule;
};

frame_class classify_frame(void* pc) {
  frame_class c;
  Dl_info info;
  if (dladdr(pc, &info) == 0 || info.dli_sname == nullptr) return c;
  c.named = true;
  const char* name = info.dli_sname;
  c.onednn = std::strstr(name, "Mkl") != nullptr || std::strstr(name, "dnnl") != nullptr;
  c.leaks = std::strstr(name, "15DatasetOpKernel7Compute") != nullptr;
  for (int i = 0; i < static_cast<int>(sizeof kRules / sizeof kRules[0]); ++i) {
    if (std::strstr(name, kRules[i].needle) != nullptr) {
      c.rule = i;
      break;
    }
  }
  return c;
}

// Return address -> its class: dladdr scans symbol tables (slow in TensorFlow's large
// libraries), and the same few call sites come again and again. Open addressing; when
// full, frames are classified without caching.
class frame_cache {
 public:
  frame_class get(void* pc) {
    const std::uintptr_t key = reinterpret_cast<std::uintptr_t>(pc);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (std::size_t i = 0, h = hash(key); i < kProbe; ++i, h = (h + 1) & (kSize - 1)) {
        if (keys_[h] == key) return values_[h];
        if (keys_[h] == 0) break;
      }
    }
    const frame_class c = classify_frame(pc);
    std::lock_guard<std::mutex> lock(mu_);
    for (std::size_t i = 0, h = hash(key); i < kProbe; ++i, h = (h + 1) & (kSize - 1)) {
      if (keys_[h] == 0 || keys_[h] == key) {
        keys_[h] = key;
        values_[h] = c;
        break;
      }
    }
    return c;
  }

 private:
  static constexpr std::size_t kSize = 4096;
  static constexpr std::size_t kProbe = 16;
  static std::size_t hash(std::uintptr_t k) { return (k * 0x9E3779B97F4A7C15ull) >> 52; }
  std::mutex mu_;
  std::uintptr_t keys_[kSize] = {};
  frame_class values_[kSize];
};

frame_cache& cache() {
  static frame_cache* c = new frame_cache;  // leaked: allocations come during static destruction
  return *c;
}

}  // namespace

caller classify_caller(unsigned fallback) {
  caller out;
  out.kind = fallback;
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  int named = 0, best = -1;
  bool decided = false;  // a refusable rule near the allocator, or a non-refusable one there
  for (int i = 1; i < n; ++i) {
    const frame_class c = cache().get(frames[i]);
    out.onednn = out.onednn || c.onednn;
    out.leaks_on_refusal = out.leaks_on_refusal || c.leaks;
    if (!c.named) continue;
    ++named;
    if (c.rule == kNoRule) continue;
    const rule& r = kRules[c.rule];
    if (!decided && named <= kNearFrames && r.refusable) {
      out.refusable = true;
      out.kind = r.kind;
    }
    decided = true;
    if (!out.refusable && priority(r.kind) > best) {
      best = priority(r.kind);
      out.kind = r.kind;
    }
  }
  return out;
}

std::string describe_stack(int frames) {
  void* pcs[kMaxFrames];
  const int n = backtrace(pcs, kMaxFrames);
  std::string line;
  for (int i = 2, shown = 0; i < n && shown < frames; ++i) {
    Dl_info info;
    if (dladdr(pcs[i], &info) == 0 || info.dli_sname == nullptr) continue;
    int status = 0;
    char* d = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
    std::string name = status == 0 && d != nullptr ? d : info.dli_sname;
    std::free(d);
    const auto paren = name.find('(');
    if (paren != std::string::npos) name.resize(paren);
    line += (line.empty() ? "" : " < ") + name;
    ++shown;
  }
  return line;
}

}  // namespace tfmg_tf
