// The library `import tensorflow` loads: site-packages/tensorflow-plugins/libtf_memguard_plugin.so.
//
// It has no TensorFlow symbol dependency (libc, libdl and libstdc++ only), so it loads
// under any TensorFlow: a plugin that fails to load makes `import tensorflow` fail for
// the whole environment (TensorFlow's load_library raises), and a plugin linked against
// one TensorFlow fails to load under another (seen: built against 2.21.0, run under
// 2.20.0, "undefined symbol: _ZN4absl12lts_2025081412log_internal10LogMessage5FlushEv").
//
// At load it finds the core (libtfmg_core.so, by dlopen), reads the running TensorFlow's
// version (TF_Version, from the libtensorflow_cc.so.2 that TensorFlow's Python module has
// loaded by then) and compares it with the version the glue was built against
// (TFMG_TF_VERSION, from setup.py or Bazel). Only when they are the same does it dlopen
// the glue (tf_memguard/libtfmg_tf.so, the code with TensorFlow headers, cc/tf/glue.cc),
// which registers the allocator. On a mismatch it warns once, TensorFlow keeps its own
// allocator, and tf_memguard.install() raises the same message (tfmg_plugin_message).
#include <dlfcn.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cc/tf/glue.h"
#include "cc/tfmg/c_api.h"

#ifndef TFMG_TF_VERSION
#define TFMG_TF_VERSION ""
#endif
#ifndef TFMG_CORE_FALLBACK_PATH
#define TFMG_CORE_FALLBACK_PATH ""
#endif

namespace {

struct core_api {
  decltype(&tfmg_abi_version) abi_version = nullptr;
  decltype(&tfmg_plugin_set_state) set_state = nullptr;
  decltype(&tfmg_plugin_set_message) set_message = nullptr;
};

void warn(const std::string& message) { std::fprintf(stderr, "tf_memguard: %s\n", message.c_str()); }

std::string directory_of(const std::string& path) {
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
  const std::string candidates[] = {directory_of(own_path()) + "/../tf_memguard/libtfmg_core.so",
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

bool env_is_true(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && (std::strcmp(v, "1") == 0 || std::strcmp(v, "true") == 0 ||
                          std::strcmp(v, "TRUE") == 0 || std::strcmp(v, "True") == 0);
}

// The running TensorFlow's version ("2.21.0"), or "" when it cannot be told. TF_Version
// is TensorFlow's C API (libtensorflow_cc.so.2), loaded by its Python module before it
// loads plugins; RTLD_NOLOAD finds that copy and loads nothing.
std::string running_tensorflow_version() {
  using version_fn = const char* (*)();
  void* fn = nullptr;
  if (void* h = dlopen("libtensorflow_cc.so.2", RTLD_LAZY | RTLD_NOLOAD)) fn = dlsym(h, "TF_Version");
  if (fn == nullptr) fn = dlsym(RTLD_DEFAULT, "TF_Version");
  if (fn == nullptr) return "";
  const char* v = reinterpret_cast<version_fn>(fn)();
  return v == nullptr ? "" : v;
}

// Where the glue is: TF_MEMGUARD_GLUE if set, else beside the core (both are built into
// tf_memguard/).
std::string glue_path(void* core) {
  if (const char* forced = std::getenv("TF_MEMGUARD_GLUE")) return forced;
  Dl_info info;
  void* symbol = dlsym(core, "tfmg_abi_version");
  if (symbol == nullptr || dladdr(symbol, &info) == 0 || info.dli_fname == nullptr) return "";
  return directory_of(info.dli_fname) + "/" TFMG_TF_GLUE_FILE;
}

void load() {
  std::string tried;
  void* core = open_core(&tried);
  if (core == nullptr) {
    warn("the core library libtfmg_core.so was not found (tried: " + tried +
         "); TensorFlow keeps its own allocator. Reinstall tf_memguard.");
    return;
  }
  core_api api;
  if (!bind(core, "tfmg_abi_version", &api.abi_version) || !bind(core, "tfmg_plugin_set_state", &api.set_state) ||
      !bind(core, "tfmg_plugin_set_message", &api.set_message) || api.abi_version() != TFMG_ABI_VERSION) {
    warn("libtfmg_core.so is from another build of tf_memguard than this plugin; TensorFlow keeps its own "
         "allocator. Reinstall tf_memguard so both come from one build.");
    return;
  }
  auto refuse = [&](int state, const std::string& message) {
    warn(message);
    api.set_message(message.c_str());
    api.set_state(state);
  };
  api.set_state(TFMG_PLUGIN_LOADED);
  if (env_is_true("TF_MEMGUARD_DISABLE")) {
    api.set_state(TFMG_PLUGIN_DISABLED);
    return;
  }
  const std::string own = own_path();
  // TF_MEMGUARD_PLUGIN=<path>: of several installed copies, only that one registers.
  if (const char* only = std::getenv("TF_MEMGUARD_PLUGIN")) {
    char mine[PATH_MAX], wanted[PATH_MAX];
    if (realpath(own.c_str(), mine) == nullptr || realpath(only, wanted) == nullptr ||
        std::strcmp(mine, wanted) != 0) {
      api.set_state(TFMG_PLUGIN_DUPLICATE);
      return;
    }
  }
  const std::string built_for = TFMG_TF_VERSION;
  const std::string running = running_tensorflow_version();
  if (running.empty() || running != built_for) {
    refuse(TFMG_PLUGIN_MISMATCH,
           "this tf_memguard was built for TensorFlow " + (built_for.empty() ? "(unknown)" : built_for) +
               ", and this is TensorFlow " + (running.empty() ? "(version unknown)" : running) +
               ": TensorFlow keeps its own allocator, and no budget can be set. Rebuild tf_memguard against "
               "this TensorFlow by reinstalling it from its source: pip install --force-reinstall --no-deps "
               "<tf_memguard's folder or sdist> (in a checkout, with an editable install: pip install "
               "--force-reinstall --no-deps -e .).");
    return;
  }
  const std::string glue = glue_path(core);
  void* handle = glue.empty() ? nullptr : dlopen(glue.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    refuse(TFMG_PLUGIN_GLUE_FAILED, "the TensorFlow glue " + glue + " did not load (" +
                                        std::string(why != nullptr ? why : "not found") +
                                        "); TensorFlow keeps its own allocator. Reinstall tf_memguard.");
    return;
  }
  tfmg_tf_glue_register_fn registration = nullptr;
  if (!bind(handle, TFMG_TF_GLUE_REGISTER, &registration)) {
    refuse(TFMG_PLUGIN_GLUE_FAILED, glue + " has no " TFMG_TF_GLUE_REGISTER "; TensorFlow keeps its own "
                                    "allocator. Reinstall tf_memguard.");
    return;
  }
  char message[512] = {0};
  // The GPU hook (a GPUProcessState of tf_memguard's) only when asked for: it has never
  // run under a CUDA build of TensorFlow, and a GPU user who does not budget the GPU must
  // get TensorFlow's own GPU allocator, untouched.
  if (registration(core, own.c_str(), env_is_true("TF_MEMGUARD_GPU") ? 1 : 0, message, sizeof message) != 0) {
    refuse(TFMG_PLUGIN_GLUE_FAILED, std::string(message) + "; TensorFlow keeps its own allocator.");
  }
}

struct on_load {
  on_load() { load(); }
} g_on_load;

}  // namespace
