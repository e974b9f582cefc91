// The TensorFlow glue: the only file that includes TensorFlow headers.
//
// Built as site-packages/tensorflow-plugins/libtf_memguard_plugin.so, which
// `import tensorflow` loads before any op runs. Its static initializer finds the core
// (libtfmg_core.so, by dlopen: no link dependency that could go missing and break
// `import tensorflow`), and registers an allocator factory above TensorFlow's default
// CPU one, so that TensorFlow's CPU device takes every tensor from the core's "CPU:0"
// pool: the same pool tf_memguard._core sees. Until tf_memguard.install() sets a
// budget, that pool passes allocations through to aligned host memory and counts them.
//
// Refusing is safe only for kernel requests (3-argument AllocateRaw with
// allocation_will_be_logged): TensorFlow turns a null into ResourceExhaustedError and
// goes on. A null for anything else (numpy/Python values made into tensors, XLA
// buffers) crashes the process, so those requests are granted over the budget and
// accounted as overshoot by the pool.
//
// oneDNN kernels are the exception among kernels (seen with TF 2.21): their helpers
// (AllocateOutputSetMklShape and others) return on a failed allocation but their
// callers go on to use the tensor, and the process dies in Tensor::flat(). oneDNN is on
// by default on CPUs with AVX-512. So when a kernel request is refused while oneDNN is
// on, the stack is checked (a refusal is rare: the cost does not matter) and a request
// from a oneDNN kernel is granted as overshoot of kind "kernel" instead; the refusal
// stays recorded, so Python can still explain it and stop the run.
#include <dlfcn.h>
#include <execinfo.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <climits>
#include <cstring>
#include <optional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cc/tfmg/c_api.h"
#include "xla/tsl/framework/allocator.h"
#include "xla/tsl/framework/allocator_registry.h"
#include "tsl/profiler/lib/scoped_memory_debug_annotation.h"
#include "tensorflow/core/common_runtime/gpu/gpu_process_state.h"

namespace tensorflow {
bool IsMKLEnabled();  // libtensorflow_framework: oneDNN on at run time
}  // namespace tensorflow

#ifndef TFMG_CORE_FALLBACK_PATH
#define TFMG_CORE_FALLBACK_PATH ""
#endif

namespace tfmg_tf {
namespace {

// The core's C interface, looked up by name.
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

void warn(const std::string& message) {
  std::fprintf(stderr, "tf_memguard: %s\n", message.c_str());
}

std::string own_directory() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&own_directory), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string own_path() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&own_path), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

// TF_MEMGUARD_CORE (a path) if set, and only it; else the copy already loaded (by
// tf_memguard._core), then beside the package in this site-packages, then where an
// in-place (editable) build put it.
void* open_core(std::string* tried) {
  if (const char* forced = std::getenv("TF_MEMGUARD_CORE")) {
    *tried = forced;
    return dlopen(forced, RTLD_NOW | RTLD_GLOBAL);
  }
  if (void* h = dlopen("libtfmg_core.so", RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) return h;
  const std::string candidates[] = {own_directory() + "/../tf_memguard/libtfmg_core.so",
                                    TFMG_CORE_FALLBACK_PATH};
  for (const std::string& path : candidates) {
    if (path.empty()) continue;
    *tried += (tried->empty() ? "" : ", ") + path;
    if (void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) return h;
  }
  return nullptr;
}

template <class F>
bool bind(void* handle, const char* name, F* slot) {
  *slot = reinterpret_cast<F>(dlsym(handle, name));
  return *slot != nullptr;
}

bool load_core() {
  std::string tried;
  void* h = open_core(&tried);
  if (h == nullptr) {
    warn("the core library libtfmg_core.so was not found (tried: " + tried +
         "); TensorFlow keeps its own allocator. Reinstall tf_memguard.");
    return false;
  }
  const bool ok = bind(h, "tfmg_abi_version", &g_api.abi_version) &&
                  bind(h, "tfmg_device_pool", &g_api.device_pool) &&
                  bind(h, "tfmg_claim_once", &g_api.claim_once) &&
                  bind(h, "tfmg_plugin_set_state", &g_api.set_state) &&
                  bind(h, "tfmg_plugin_set_path", &g_api.set_path) &&
                  bind(h, "tfmg_pool_allocate", &g_api.allocate) &&
                  bind(h, "tfmg_pool_deallocate", &g_api.deallocate) &&
                  bind(h, "tfmg_pool_get_stats", &g_api.get_stats) &&
                  bind(h, "tfmg_pool_clear_stats", &g_api.clear_stats) &&
                  bind(h, "tfmg_profile_batch", &g_api.profile_batch) &&
                  bind(h, "tfmg_device_pool_find", &g_api.device_pool_find) &&
                  bind(h, "tfmg_device_pool_configure", &g_api.device_pool_configure);
  if (!ok) {
    warn("libtfmg_core.so lacks a symbol this plugin needs; TensorFlow keeps its own allocator. "
         "Reinstall tf_memguard so both come from one build.");
    return false;
  }
  if (g_api.abi_version() != TFMG_ABI_VERSION) {
    warn("libtfmg_core.so has ABI version " + std::to_string(g_api.abi_version()) +
         ", the plugin expects " + std::to_string(TFMG_ABI_VERSION) +
         "; TensorFlow keeps its own allocator. Reinstall tf_memguard.");
    return false;
  }
  return true;
}

// True if a oneDNN (Mkl*) kernel is on the calling thread's stack. Call only on the
// refusal path: backtrace() and dladdr() are slow.
bool onednn_kernel_on_stack() {
  static const bool onednn = tensorflow::IsMKLEnabled();
  if (!onednn) return false;
  void* frames[64];
  const int n = backtrace(frames, 64);
  for (int i = 0; i < n; ++i) {
    Dl_info info;
    if (dladdr(frames[i], &info) != 0 && info.dli_sname != nullptr &&
        (std::strstr(info.dli_sname, "Mkl") != nullptr || std::strstr(info.dli_sname, "dnnl") != nullptr)) {
      return true;
    }
  }
  return false;
}

std::string human(uint64_t bytes) {
  char buf[32];
  if (bytes >= (1ull << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / double(1ull << 30));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / double(1ull << 20));
  }
  return buf;
}

// While a batch size is being profiled: TFMG_ALLOC_BATCH if the tensor being allocated
// has it as its first dimension. OpKernelContext::allocate_tensor announces the shape
// through the thread's memory-debug annotation; reading it formats a string, so this
// runs only during the few steps MemGuardCallback profiles.
uint32_t batch_tag() {
  const int64_t batch = g_api.profile_batch();
  if (batch <= 0) return 0;
  const auto& note = tsl::profiler::ScopedMemoryDebugAnnotation::CurrentAnnotation();
  if (!note.pending_shape_func) return 0;
  const std::string shape = note.pending_shape_func();  // "[64,30,30,16]"
  if (shape.size() < 3 || shape[0] != '[') return 0;
  const long long first = std::strtoll(shape.c_str() + 1, nullptr, 10);
  return first == batch ? TFMG_ALLOC_BATCH : 0;
}

class pool_allocator final : public tsl::Allocator {
 public:
  explicit pool_allocator(tfmg_pool* pool) : pool_(pool) {}

  std::string Name() override { return "tf_memguard"; }

  // No attributes: runtime and XLA buffers. A null here is a crash, never refuse.
  void* AllocateRaw(size_t alignment, size_t num_bytes) override {
    return allocate(alignment, num_bytes, TFMG_ALLOC_MUST_SUCCEED | TFMG_ALLOC_KIND(TFMG_KIND_RAW));
  }

  void* AllocateRaw(size_t alignment, size_t num_bytes,
                    const tsl::AllocationAttributes& attrs) override {
    // Only kernels (OpKernelContext) set allocation_will_be_logged, and only there does
    // TensorFlow turn a null into ResourceExhaustedError.
    if (attrs.allocation_will_be_logged) {
      const uint32_t tag = batch_tag() | TFMG_ALLOC_KIND(TFMG_KIND_KERNEL);
      void* p = allocate(alignment, num_bytes, tag);
      if (p == nullptr && onednn_kernel_on_stack()) {
        p = allocate(alignment, num_bytes, TFMG_ALLOC_MUST_SUCCEED | tag);
        static std::atomic<bool> warned{false};
        if (p != nullptr && !warned.exchange(true)) {
          warn("a oneDNN kernel asked for " + human(num_bytes) +
               " that does not fit the CPU:0 budget. oneDNN kernels crash when an allocation is "
               "refused (a TensorFlow bug), so it was granted over the budget and counted as "
               "overshoot; tf_memguard.MemGuardCallback stops the run after this step. For a hard "
               "budget, start Python with TF_ENABLE_ONEDNN_OPTS=0.");
        }
      }
      return p;
    }
    return allocate(alignment, num_bytes,
                    TFMG_ALLOC_MUST_SUCCEED | TFMG_ALLOC_KIND(TFMG_KIND_TENSOR) | batch_tag());
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

  tsl::AllocatorMemoryType GetMemoryType() const override {
    return tsl::AllocatorMemoryType::kHostPageable;
  }

 private:
  void* allocate(size_t alignment, size_t num_bytes, uint32_t flags) {
    void* p = nullptr;
    g_api.allocate(pool_, num_bytes, alignment, flags, &p);
    return p;  // null only for a refused kernel request (or a failed upstream)
  }

  tfmg_pool* pool_;
};

// A SubAllocator over the same pool, for TensorFlow code that asks the registry for one.
class pool_sub_allocator final : public tsl::SubAllocator {
 public:
  explicit pool_sub_allocator(tfmg_pool* pool) : tsl::SubAllocator({}, {}), pool_(pool) {}
  void* Alloc(size_t alignment, size_t num_bytes, size_t* bytes_received) override {
    void* p = nullptr;
    g_api.allocate(pool_, num_bytes, alignment,
                   TFMG_ALLOC_MUST_SUCCEED | TFMG_ALLOC_KIND(TFMG_KIND_RAW), &p);
    *bytes_received = p != nullptr ? num_bytes : 0;
    return p;
  }
  void Free(void* ptr, size_t) override { g_api.deallocate(pool_, ptr, nullptr); }
  bool SupportsCoalescing() const override { return false; }
  tsl::AllocatorMemoryType GetMemoryType() const override {
    return tsl::AllocatorMemoryType::kHostPageable;
  }

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
// subclass, installed from the plugin's initializer (before TF creates GPU devices),
// hands out tf_memguard's pool of "GPU:<id>" when install(device="GPU:<id>") created
// one (CUDA upstream), and TensorFlow's own allocator otherwise. TF needs GetStats()
// from a GPU allocator; pool_allocator has it.
class gpu_process_state final : public tensorflow::GPUProcessState {
 public:
  tensorflow::Allocator* GetGPUAllocator(const tensorflow::GPUOptions& options,
                                         tsl::TfDeviceId tf_device_id, size_t total_bytes,
                                         const std::vector<tsl::TfDeviceId>& peer_gpu_ids) override {
    const std::string device = "GPU:" + std::to_string(tf_device_id.value());
    tfmg_pool* pool = nullptr;
    if (g_api.device_pool_find != nullptr && g_api.device_pool_find(device.c_str(), &pool) == TFMG_OK) {
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
  if (tensorflow::GPUProcessState::singleton(g_gpu_state) == g_gpu_state) {
    g_api.set_state(TFMG_PLUGIN_GPU_HOOK);
  }
}

// Above every CPU allocator TensorFlow registers: DefaultCPUAllocator (100) and
// MklCPUAllocator (200 when oneDNN is on, the default on CPUs with AVX-512; a tie would
// be broken "by unspecified criteria").
constexpr int kPriority = 1000;

bool env_is_true(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0 ||
                          std::strcmp(v, "TRUE") == 0 || std::strcmp(v, "True") == 0);
}

void register_with_tensorflow() {
  if (!load_core()) return;
  g_api.set_state(TFMG_PLUGIN_LOADED);
  if (env_is_true("TF_MEMGUARD_DISABLE")) {
    g_api.set_state(TFMG_PLUGIN_DISABLED);
    return;
  }
  // TF_MEMGUARD_PLUGIN=<path>: of several installed copies, only that one registers.
  if (const char* only = std::getenv("TF_MEMGUARD_PLUGIN")) {
    char mine[4096], wanted[4096];
    const std::string own = own_path();
    if (realpath(own.c_str(), mine) == nullptr || realpath(only, wanted) == nullptr ||
        std::strcmp(mine, wanted) != 0) {
      g_api.set_state(TFMG_PLUGIN_DUPLICATE);
      return;
    }
  }
  // Two installed copies of the plugin would both register, and a second registration
  // with the same name and priority aborts the process: only the first one does.
  if (!g_api.claim_once("tensorflow-cpu-allocator-factory")) {
    g_api.set_state(TFMG_PLUGIN_DUPLICATE);
    return;
  }
  tfmg_pool* pool = nullptr;
  if (g_api.device_pool("CPU:0", &pool) != TFMG_OK) {
    warn("could not create the CPU:0 pool; TensorFlow keeps its own allocator.");
    return;
  }
  g_api.set_path(own_path().c_str());
  // Owned by the registry for the rest of the process.
  static tsl::AllocatorFactoryRegistration registration(__FILE__, __LINE__, "tf_memguard",
                                                        kPriority,
                                                        new pool_allocator_factory(pool));
  g_api.set_state(TFMG_PLUGIN_REGISTERED);
  install_gpu_hook();
}

}  // namespace
}  // namespace tfmg_tf

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
  if (g_gpu_state == nullptr) return fail(1, "the plugin did not install its GPUProcessState");
  if (tensorflow::GPUProcessState::singleton() != g_gpu_state) {
    return fail(2, "GPUProcessState::singleton() is not tf_memguard's");
  }
  tfmg_pool_options o;
  std::memset(&o, 0, sizeof o);
  o.max_bytes = 64u << 20;
  o.upstream = TFMG_UPSTREAM_HOST;
  if (g_api.device_pool_configure("GPU:0", &o) != TFMG_OK) return fail(3, "could not configure GPU:0");
  tensorflow::Allocator* a =
      tensorflow::GPUProcessState::singleton()->GetGPUAllocator(tsl::TfDeviceId(0));
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

namespace tfmg_tf {
namespace {

struct on_load {
  on_load() { register_with_tensorflow(); }
} g_on_load;

}  // namespace
}  // namespace tfmg_tf
