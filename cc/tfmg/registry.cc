// Process-wide state of the core: one pool per device name, shared by the TensorFlow
// plugin and the Python module (both reach this same copy of libtfmg_core.so), and
// what the plugin reported about itself.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "cc/tfmg/c_api.h"

namespace {

struct registry {
  std::mutex mutex;
  std::map<std::string, tfmg_pool*> pools;
  std::map<std::string, int> upstreams;  // device -> tfmg_upstream_kind of its pool  // never destroyed: TF may free at exit
  std::set<std::string> claims;
  std::string plugin_path;
  std::string plugin_message;
};

registry& get() {
  // Leaked on purpose: TensorFlow frees tensors during static destruction, after which
  // a destroyed registry (or pool) would be used.
  static registry* r = new registry;
  return *r;
}

std::atomic<int> plugin_state{0};
std::atomic<int64_t> profile_batch{0};

}  // namespace

// Layout and tracing knobs for experiments and benchmarks (see benchmarks/NOTES.md),
// applied to every process-wide pool.
static void apply_environment(tfmg_pool_options* o) {
  if (const char* v = std::getenv("TF_MEMGUARD_SMALL_THRESHOLD")) o->small_threshold = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("TF_MEMGUARD_REGION_BYTES")) o->region_bytes = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("TF_MEMGUARD_TRACE_CAPACITY")) o->trace_capacity = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("TF_MEMGUARD_ADDRESS_FACTOR")) o->address_factor = std::strtoull(v, nullptr, 10);
  if (const char* v = std::getenv("TF_MEMGUARD_TRIM_ABOVE_PEAK")) o->trim_above_peak = std::strtod(v, nullptr);
  if (const char* v = std::getenv("TF_MEMGUARD_ZONE_THRESHOLD")) o->zone_threshold = std::strtoull(v, nullptr, 10);
  // Host pools: backed on demand by default ("lazy": the budget bounds the bytes backed,
  // not address space); "plain": one region of the budget; "checked": backed on demand
  // with unbacked granules PROT_NONE.
  if (o->upstream == TFMG_UPSTREAM_HOST) {
    const char* v = std::getenv("TF_MEMGUARD_HOST_UPSTREAM");
    if (v == nullptr || std::strcmp(v, "lazy") == 0) {
      o->upstream = TFMG_UPSTREAM_HOST_LAZY;
    } else if (std::strcmp(v, "checked") == 0) {
      o->upstream = TFMG_UPSTREAM_HOST_ON_DEMAND;
    }  // "plain" (or anything else): as asked
  }
}

extern "C" {

tfmg_status tfmg_device_pool(const char* device, tfmg_pool** out) {
  if (device == nullptr || *device == '\0' || out == nullptr) return TFMG_ERROR_INVALID_ARGUMENT;
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.pools.find(device);
  if (it != r.pools.end()) {
    *out = it->second;
    return TFMG_OK;
  }
  tfmg_pool_options o;
  tfmg_pool_options_init(&o);
  const int requested = static_cast<int>(o.upstream);  // before the environment's knobs
  apply_environment(&o);
  tfmg_pool* p = nullptr;
  const tfmg_status s = tfmg_pool_create(&o, &p);
  if (s != TFMG_OK) return s;
  r.pools.emplace(device, p);
  r.upstreams[device] = requested;
  *out = p;
  return TFMG_OK;
}

tfmg_status tfmg_device_pool_configure(const char* device, const tfmg_pool_options* options) {
  if (device == nullptr || *device == '\0' || options == nullptr) return TFMG_ERROR_INVALID_ARGUMENT;
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.pools.find(device);
  if (it != r.pools.end()) {
    return r.upstreams[device] == static_cast<int>(options->upstream) ? TFMG_OK : TFMG_ERROR_INVALID_STATE;
  }
  tfmg_pool_options o = *options;
  apply_environment(&o);
  tfmg_pool* p = nullptr;
  const tfmg_status s = tfmg_pool_create(&o, &p);
  if (s != TFMG_OK) return s;
  r.pools.emplace(device, p);
  r.upstreams[device] = static_cast<int>(options->upstream);
  return TFMG_OK;
}

tfmg_status tfmg_device_pool_find(const char* device, tfmg_pool** out) {
  if (device == nullptr || out == nullptr) return TFMG_ERROR_INVALID_ARGUMENT;
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.pools.find(device);
  if (it == r.pools.end()) return TFMG_ERROR_INVALID_STATE;
  *out = it->second;
  return TFMG_OK;
}

int tfmg_claim_once(const char* key) {
  if (key == nullptr) return 0;
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.claims.insert(key).second ? 1 : 0;
}

void tfmg_set_profile_batch(int64_t batch_size) { profile_batch.store(batch_size > 0 ? batch_size : 0); }
int64_t tfmg_profile_batch(void) { return profile_batch.load(std::memory_order_relaxed); }

void tfmg_plugin_set_state(int flags) { plugin_state.fetch_or(flags); }
int tfmg_plugin_state(void) { return plugin_state.load(); }

void tfmg_plugin_set_path(const char* path) {
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.plugin_path = path == nullptr ? "" : path;
}

void tfmg_plugin_set_message(const char* message) {
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.plugin_message = message == nullptr ? "" : message;
}

const char* tfmg_plugin_message(void) {
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.plugin_message.c_str();  // set at plugin load, stable after
}

const char* tfmg_plugin_path(void) {
  registry& r = get();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.plugin_path.c_str();  // set once at plugin load, stable after
}

}  // extern "C"
