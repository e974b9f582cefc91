// The TensorFlow glue: the only file that includes TensorFlow headers.
//
// Built as tf_memguard/libtfmg_tf.so against one TensorFlow, and loaded by the plugin
// (cc/tf/loader.cc) only under that TensorFlow. tfmg_tf_glue_register() registers an
// allocator factory above TensorFlow's CPU ones, so that TensorFlow's CPU device takes
// every tensor from the core's "CPU:0" pool: the same pool tf_memguard._core sees.
// Until tf_memguard.install() sets a budget, that pool passes allocations through to
// aligned host memory and counts them.
//
// Which requests may be refused (benchmarks/NOTES.md, "Which requests can be refused"):
// - Kernel requests (3-argument AllocateRaw with allocation_will_be_logged, from
//   OpKernelContext): TensorFlow turns a null into ResourceExhaustedError and goes on.
//   oneDNN kernels are the exception (seen with TF 2.21: their helpers return on a failed
//   allocation but their callers use the tensor, and the process dies in Tensor::flat()),
//   so a refused request with a oneDNN kernel on the stack is granted as overshoot of
//   kind "kernel", the refusal stays recorded, and Python stops the run.
// - Everything else is first tried quietly; only when it does not fit is the caller read
//   off the stack (cc/tf/caller.h): constants made from protos and tf.data's batches
//   check for a null and are refused; the rest (numpy inputs, XLA buffers, deep copies,
//   tf.data's elements) would crash, and is granted over the budget as overshoot of its
//   kind. Overshoot counts against the budget (the pool refuses the next refusable
//   request instead), and MemGuardCallback names what holds it.
#include "cc/tf/glue.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cc/tf/caller.h"
#include "cc/tfmg/c_api.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"
#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/framework/allocator_registry.h"

namespace tfmg_tf {
namespace {

// The core's C interface, looked up by name in the handle the loader passes.
struct core_api {
  decltype(&tfmg_abi_version) abi_version;
  decltype(&tfmg_device_pool) device_pool;
  decltype(&tfmg_claim_once) claim_once;
  decltype(&tfmg_plugin_set_state) set_state;
  decltype(&tfmg_plugin_set_path) set_path;
  decltype(&tfmg_pool_allocate) allocate;
  decltype(&tfmg_pool_deallocate) deallocate;
  decltype(&tfmg_pool_get_stats) get_stats;
  decltype(&tfmg_pool_clear_stats) clear_stats;
  decltype(&tfmg_profile_batch) profile_batch;
  decltype(&tfmg_device_pool_find) device_pool_find;
  decltype(&tfmg_device_pool_configure) device_pool_configure;
};

core_api g_api;

void warn(const std::string& message) { std::fprintf(stderr, "tf_memguard: %s\n", message.c_str()); }

template <class F>
bool bind(void* handle, const char* name, F* slot) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
  return *slot != nullptr;
}

bool bind_core(void* h) {
  return bind(h, "tfmg_abi_version", &g_api.abi_version) && bind(h, "tfmg_device_pool", &g_api.device_pool) &&
         bind(h, "tfmg_claim_once", &g_api.claim_once) && bind(h, "tfmg_plugin_set_state", &g_api.set_state) &&
         bind(h, "tfmg_plugin_set_path", &g_api.set_path) && bind(h, "tfmg_pool_allocate", &g_api.allocate) &&
         bind(h, "tfmg_pool_deallocate", &g_api.deallocate) && bind(h, "tfmg_pool_get_stats", &g_api.get_stats) &&
         bind(h, "tfmg_pool_clear_stats", &g_api.clear_stats) &&
         bind(h, "tfmg_profile_batch", &g_api.profile_batch) &&
         bind(h, "tfmg_device_pool_find", &g_api.device_pool_find) &&
         bind(h, "tfmg_device_pool_configure", &g_api.device_pool_configure) &&
         g_api.abi_version() == TFMG_ABI_VERSION;
}

std::string human(uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(1ull << 30));
  } else if (bytes >= (1ull << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / double(1ull << 20));
  } else if (bytes >= (1ull << 10)) {
    std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / double(1ull << 10));
  } else {
    std::snprintf(buf, sizeof buf, "%llu bytes", static_cast<unsigned long long>(bytes));
  }
  return buf;
}

// While a batch size is being profiled: TFMG_ALLOC_BATCH if the tensor being allocated
// has it as its first dimension, TFMG_ALLOC_BATCH_ROWS if a multiple of it, and with
// either TFMG_ALLOC_BATCH_SQUARE if its second dimension is a multiple of it too (a
// batch x batch tensor). OpKernelContext::allocate_tensor announces the shape
// through the thread's memory-debug annotation; reading it formats a string, so this
// runs only during the few steps MemGuardCallback profiles.
uint32_t batch_tag() {
  const int64_t batch = g_api.profile_batch();
  if (batch <= 0) return 0;
  const auto& note = tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation();
  if (!note.pending_shape_func) return 0;
  const std::string shape = note.pending_shape_func();  // "[64,30,30,16]"
  if (shape.size() < 3 || shape[0] != '[') return 0;
  char* end = nullptr;
  const long long first = std::strtoll(shape.c_str() + 1, &end, 10);
  const uint32_t tag = first == batch ? TFMG_ALLOC_BATCH
                       : first > batch && first % batch == 0 ? TFMG_ALLOC_BATCH_ROWS : 0u;
  if (tag == 0 || end == nullptr || *end != ',') return tag;
  const long long second = std::strtoll(end + 1, nullptr, 10);
  return second >= batch && second % batch == 0 ? tag | TFMG_ALLOC_BATCH_SQUARE : tag;
}

// TF_MEMGUARD_LOG_UNREFUSABLE=<bytes>: every request of at least that size granted over
// the budget is printed with the named frames of its stack, to find the path.
void log_unrefusable(size_t num_bytes, unsigned kind) {
  static const long long threshold = [] {
    const char* v = std::getenv("TF_MEMGUARD_LOG_UNREFUSABLE");
    return v == nullptr ? -1LL : std::strtoll(v, nullptr, 10);
  }();
  if (threshold < 0 || static_cast<long long>(num_bytes) < threshold) return;
  std::fprintf(stderr, "tf_memguard: granted over the budget, kind %u, %zu bytes: %s\n", kind, num_bytes,
               describe_stack(8).c_str());
}

// Unlogged requests of at least this size are classified even when they fit, so that the
// bytes in use by kind say what holds the budget (Keras' copy of the data, tf.data's
// buffers); smaller ones (scalars, shapes: thousands a step) keep the fallback kind.
constexpr size_t kClassifyAbove = 64 << 10;

class pool_allocator final : public tsl::Allocator {
 public:
  explicit pool_allocator(tfmg_pool* pool) : pool_(pool) {}

  std::string Name() override { return "tf_memguard"; }

  // No attributes: runtime buffers (TF_NewTensor's copy of a numpy array, Eigen's).
  // Their callers never check: a null here is a crash.
  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    return serve_unlogged(alignment, num_bytes, TFMG_KIND_RAW, /*may_refuse=*/false);
  }

  void* AllocateRaw(size_t alignment, size_t num_bytes, const tsl::AllocationAttributes& attrs) override {
    if (attrs.allocation_will_be_logged) return serve_kernel(alignment, num_bytes);
    return serve_unlogged(alignment, num_bytes, TFMG_KIND_TENSOR, /*may_refuse=*/true);
  }

  // Pointers the pool does not know (seen after an XLA out-of-memory) are ignored:
  // never passed to free().
  void DeallocateRaw(void* ptr) override { g_api.deallocate(pool_, ptr, nullptr); }
  void DeallocateRaw(void* ptr, size_t, size_t) override { g_api.deallocate(pool_, ptr, nullptr); }

  std::optional<tsl::AllocatorStats> GetStats() override {
    tfmg_stats s;
    if (g_api.get_stats(pool_, &s) != TFMG_OK) return std::nullopt;
    tsl::AllocatorStats out;
    out.num_allocs = s.num_allocs;
    out.bytes_in_use = s.bytes_in_use;
    out.peak_bytes_in_use = s.peak_bytes_in_use;
    out.largest_alloc_size = s.largest_alloc_size;
    if (s.bytes_limit != 0) out.bytes_limit = s.bytes_limit;
    out.bytes_reserved = s.bytes_reserved;
    out.peak_bytes_reserved = s.peak_bytes_reserved;
    out.largest_free_block_bytes = s.largest_free_block_bytes;
    return out;
  }

  bool ClearStats() override { return g_api.clear_stats(pool_) == TFMG_OK; }

  tsl::AllocatorMemoryType GetMemoryType() const override { return tsl::AllocatorMemoryType::kHostPageable; }

 private:
  void* allocate(size_t alignment, size_t num_bytes, uint32_t flags) {
    void* p = nullptr;
    g_api.allocate(pool_, num_bytes, alignment, flags, &p);
    return p;  // null for a refused request (or a failed upstream)
  }

  void* serve_kernel(size_t alignment, size_t num_bytes) {
    const uint32_t tag = batch_tag() | TFMG_ALLOC_KIND(TFMG_KIND_KERNEL);
    // A request that does not fit waits for what the kernels running on other threads
    // free (the pool's wait time, set by tf_memguard.install()), behind any request that
    // waits already; quiet: what a refusal does depends on the caller, read below.
    void* p = allocate(alignment, num_bytes, tag | TFMG_ALLOC_QUIET | TFMG_ALLOC_WAIT);
    if (p != nullptr) return p;
    const caller who = classify_caller(TFMG_KIND_KERNEL);
    if (who.leaks_on_refusal) {
      // A dataset's scalar handle: tiny, and refusing it leaks the dataset (caller.h).
      return allocate(alignment, num_bytes, TFMG_ALLOC_MUST_SUCCEED | TFMG_ALLOC_KIND(TFMG_KIND_DATA));
    }
    if (!who.onednn) return allocate(alignment, num_bytes, tag);  // refused (it waited), and recorded
    p = allocate(alignment, num_bytes, TFMG_ALLOC_MUST_SUCCEED | tag);
    static std::atomic<bool> warned{false};
    if (p != nullptr && !warned.exchange(true)) {
      warn("a oneDNN kernel asked for " + human(num_bytes) +
           " that does not fit the CPU:0 budget. oneDNN kernels crash when an allocation is refused (a "
           "TensorFlow bug), so it was granted over the budget and counted as overshoot; "
           "tf_memguard.MemGuardCallback stops the run after this step. For a hard budget, start Python with "
           "TF_ENABLE_ONEDNN_OPTS=0.");
    }
    return p;
  }

  void* serve_unlogged(size_t alignment, size_t num_bytes, unsigned fallback, bool may_refuse) {
    const uint32_t tag = batch_tag();
    // Fast path: most requests are small, and fit.
    if (num_bytes < kClassifyAbove) {
      if (void* p = allocate(alignment, num_bytes, tag | TFMG_ALLOC_QUIET | TFMG_ALLOC_KIND(fallback))) return p;
    }
    const caller who = classify_caller(fallback);
    const uint32_t kind = TFMG_ALLOC_KIND(who.kind);
    // tf.data's batches are made beside the step and wait (behind the kernels that wait)
    // for what its kernels free; constants are made while a function is traced, with no
    // other thread to free.
    const uint32_t wait = may_refuse && who.refusable && who.kind == TFMG_KIND_DATA ? TFMG_ALLOC_WAIT : 0u;
    if (void* p = allocate(alignment, num_bytes, tag | TFMG_ALLOC_QUIET | kind | wait)) return p;
    if (may_refuse && who.refusable) {
      // Recorded as a refusal this time (a block freed meanwhile may even let it through).
      void* p = allocate(alignment, num_bytes, tag | kind);
      if (p == nullptr && who.kind == TFMG_KIND_CONSTANT) {
        static std::atomic<bool> warned{false};
        if (!warned.exchange(true)) {
          // How full the budget was says which it is: a large constant, or a small one
          // met when the budget was already taken (a dataset's copy of the arrays).
          tfmg_stats st;
          std::string state;
          if (g_api.get_stats(pool_, &st) == TFMG_OK && st.bytes_limit > 0) {
            state = " (" + human(uint64_t(st.bytes_in_use)) + " of " + human(uint64_t(st.bytes_limit)) +
                    " in use)";
          }
          warn("a constant of " + human(num_bytes) + " does not fit the CPU:0 budget" + state +
               " and was refused: TensorFlow reports it as InvalidArgumentError 'Cannot parse tensor from proto' (a "
               "large constant often comes from constant folding of a tensor shaped by the batch size: a smaller "
               "batch needs less; with the budget all but taken, what takes it, such as a tf.data copy of the "
               "arrays, is the one to shrink).");
        }
      }
      return p;
    }
    log_unrefusable(num_bytes, who.kind);
    void* p = allocate(alignment, num_bytes, TFMG_ALLOC_MUST_SUCCEED | tag | kind);
    if (p != nullptr && who.kind == TFMG_KIND_INPUT && num_bytes >= kWarnInputAbove) warn_input_over(num_bytes);
    return p;
  }

  // Arrays made into tensors cannot be refused (their callers crash on a null), so data
  // larger than the budget takes it whole, and every request after it that can be is
  // refused: with 300 MiB of arrays under 64 MiB, fit() failed in Keras' set-up, before
  // any callback runs, with TensorFlow's "OOM when allocating tensor with shape[] and
  // type resource" and nothing to say why. Said once, when such a copy first passes the
  // budget. (1 MiB and more: the values a step passes, scalars and shapes, are smaller.)
  static constexpr size_t kWarnInputAbove = 1 << 20;

  void warn_input_over(size_t num_bytes) {
    static std::atomic<bool> warned{false};
    if (warned.exchange(true)) return;
    tfmg_stats st;
    std::string state;
    if (g_api.get_stats(pool_, &st) == TFMG_OK && st.bytes_limit > 0) {
      state = " (" + human(uint64_t(st.bytes_in_use)) + " in use, the budget " + human(uint64_t(st.bytes_limit)) +
              ")";
    }
    warn("numpy arrays or Python values made into a tensor of " + human(num_bytes) +
         " (Keras' copy of the training or validation arrays, or a tf.data.Dataset.from_tensor_slices of them) "
         "did not fit the CPU:0 budget" + state + " and were granted over it: TensorFlow crashes when such a "
         "request is refused. Until that memory is freed, every request that can be refused is refused, so the "
         "next step or iterator fails with a ResourceExhaustedError. Pass a budget that holds the arrays as well "
         "as the training step, or read the data in pieces (a tf.data pipeline over files, or a "
         "keras.utils.PyDataset).");
  }

  tfmg_pool* pool_;
};

// A SubAllocator over the same pool, for TensorFlow code that asks the registry for one.
class pool_sub_allocator final : public tsl::SubAllocator {
 public:
  explicit pool_sub_allocator(tfmg_pool* pool) : tsl::SubAllocator({}, {}), pool_(pool) {}
  void* Alloc(size_t alignment, size_t num_bytes, size_t* bytes_received) override {
    void* p = nullptr;
    g_api.allocate(pool_, num_bytes, alignment, TFMG_ALLOC_MUST_SUCCEED | TFMG_ALLOC_KIND(TFMG_KIND_RAW), &p);
    *bytes_received = p != nullptr ? num_bytes : 0;
    return p;
  }
  void Free(void* ptr, size_t) override { g_api.deallocate(pool_, ptr, nullptr); }
  bool SupportsCoalescing() const override { return false; }
  tsl::AllocatorMemoryType GetMemoryType() const override { return tsl::AllocatorMemoryType::kHostPageable; }

 private:
  tfmg_pool* pool_;
};

class pool_allocator_factory final : public tsl::AllocatorFactory {
 public:
  explicit pool_allocator_factory(tfmg_pool* pool) : pool_(pool) {}
  // Called lazily, at TensorFlow's first CPU allocation.
  tsl::Allocator* CreateAllocator() override {
    g_api.set_state(TFMG_PLUGIN_SERVING);
    return new pool_allocator(pool_);
  }
  tsl::SubAllocator* CreateSubAllocator(int) override { return new pool_sub_allocator(pool_); }

 private:
  tfmg_pool* pool_;
};

// TensorFlow's GPU devices take their allocator from GPUProcessState::singleton(). This
// subclass, installed at registration when TF_MEMGUARD_GPU=1 (before TF creates GPU
// devices), hands out tf_memguard's pool of "GPU:<id>" when install(device="GPU:<id>")
// created one (CUDA upstream), and TensorFlow's own allocator otherwise. TF needs
// GetStats() from a GPU allocator; pool_allocator has it.
class gpu_process_state final : public tensorflow::GPUProcessState {
 public:
  tensorflow::Allocator* GetGPUAllocator(const tensorflow::GPUOptions& options, tsl::TfDeviceId tf_device_id,
                                         size_t total_bytes,
                                         const std::vector<tsl::TfDeviceId>& peer_gpu_ids) override {
    const std::string device = "GPU:" + std::to_string(tf_device_id.value());
    tfmg_pool* pool = nullptr;
    if (g_api.device_pool_find(device.c_str(), &pool) == TFMG_OK) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = allocators_.find(device);
      if (it == allocators_.end()) it = allocators_.emplace(device, new pool_allocator(pool)).first;
      return it->second;
    }
    return GPUProcessState::GetGPUAllocator(options, tf_device_id, total_bytes, peer_gpu_ids);
  }

 private:
  std::mutex mu_;
  std::map<std::string, tensorflow::Allocator*> allocators_;  // live for the process
};

gpu_process_state* g_gpu_state = nullptr;

void install_gpu_hook() {
  // singleton(ps) keeps the first instance; if TF made its own already, ours is ignored
  // (and the flag below stays off).
  g_gpu_state = new gpu_process_state;
  if (tensorflow::GPUProcessState::singleton(g_gpu_state) == g_gpu_state) g_api.set_state(TFMG_PLUGIN_GPU_HOOK);
}

// Above every CPU allocator TensorFlow registers: DefaultCPUAllocator (100) and
// MklCPUAllocator (200 when oneDNN is on, the default on CPUs with AVX-512; a tie would
// be broken "by unspecified criteria").
constexpr int kPriority = 1000;

}  // namespace
}  // namespace tfmg_tf

extern "C" __attribute__((visibility("default"))) int tfmg_tf_glue_register(void* core, const char* plugin_path,
                                                                            int gpu_hook, char* msg, size_t n) {
  using namespace tfmg_tf;
  if (core == nullptr || !bind_core(core)) {
    std::snprintf(msg, n, "libtfmg_core.so lacks what the TensorFlow glue needs (another build?); reinstall tf_memguard");
    return 1;
  }
  // Two installed copies of the plugin would both register, and a second registration
  // with the same name and priority aborts the process: only the first one does.
  if (!g_api.claim_once("tensorflow-cpu-allocator-factory")) {
    g_api.set_state(TFMG_PLUGIN_DUPLICATE);
    return 0;
  }
  tfmg_pool* pool = nullptr;
  if (g_api.device_pool("CPU:0", &pool) != TFMG_OK) {
    std::snprintf(msg, n, "could not create the CPU:0 pool");
    return 2;
  }
  g_api.set_path(plugin_path);
  // Owned by the registry for the rest of the process.
  static tsl::AllocatorFactoryRegistration registration(__FILE__, __LINE__, "tf_memguard", kPriority,
                                                        new pool_allocator_factory(pool));
  g_api.set_state(TFMG_PLUGIN_REGISTERED);
  if (gpu_hook) install_gpu_hook();
  return 0;
}

// For tests on machines without a GPU (the CPU wheel): configures "GPU:0" as a pool
// over host memory standing in for the device, and checks that TensorFlow's GPU
// allocator hook hands out memory from it, counts it, and refuses a kernel's request
// over the budget. Returns 0, or a failure code with a message in buf.
extern "C" __attribute__((visibility("default"))) int tfmg_plugin_gpu_selftest(char* buf, size_t n) {
  using namespace tfmg_tf;
  auto fail = [&](int code, const char* what) {
    std::snprintf(buf, n, "%s", what);
    return code;
  };
  if (g_gpu_state == nullptr) return fail(1, "the glue did not install its GPUProcessState (TF_MEMGUARD_GPU=1?)");
  if (tensorflow::GPUProcessState::singleton() != g_gpu_state) {
    return fail(2, "GPUProcessState::singleton() is not tf_memguard's");
  }
  tfmg_pool_options o;
  std::memset(&o, 0, sizeof o);
  o.max_bytes = 64u << 20;
  o.upstream = TFMG_UPSTREAM_HOST;
  if (g_api.device_pool_configure("GPU:0", &o) != TFMG_OK) return fail(3, "could not configure GPU:0");
  tensorflow::Allocator* a = tensorflow::GPUProcessState::singleton()->GetGPUAllocator(tsl::TfDeviceId(0));
  if (a == nullptr || a->Name() != "tf_memguard") return fail(4, "GetGPUAllocator did not return the pool");
  void* p = a->AllocateRaw(256, 1u << 20);
  auto stats = a->GetStats();
  if (p == nullptr || !stats || stats->bytes_in_use < (1 << 20) || !stats->bytes_limit ||
      *stats->bytes_limit != (64 << 20)) {
    return fail(5, "allocation through the hook was not served or not counted");
  }
  tsl::AllocationAttributes kernel;
  kernel.allocation_will_be_logged = true;
  void* big = a->AllocateRaw(256, 128u << 20, kernel);
  a->DeallocateRaw(p);
  if (big != nullptr) return fail(6, "a kernel's request over the budget was not refused");
  std::snprintf(buf, n, "ok");
  return 0;
}
