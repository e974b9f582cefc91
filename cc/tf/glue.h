// The one call between the plugin that `import tensorflow` loads (cc/tf/loader.cc, which
// has no TensorFlow symbol dependency and so loads under any TensorFlow) and the glue
// built against one TensorFlow (cc/tf/glue.cc, tf_memguard/libtfmg_tf.so), which the
// loader dlopen()s only when the running TensorFlow is the one it was built for.
#ifndef TFMG_TF_GLUE_H_
#define TFMG_TF_GLUE_H_

#include <stddef.h>

// Registers tf_memguard's allocator factory with TensorFlow. `core`: the dlopen() handle
// of libtfmg_core.so; `plugin_path`: the loader's file; `gpu_hook`: also install the
// GPUProcessState hook (TF_MEMGUARD_GPU=1). Returns 0, or non-zero with a message in msg.
extern "C" typedef int (*tfmg_tf_glue_register_fn)(void* core, const char* plugin_path, int gpu_hook,
                                                   char* msg, size_t n);
#define TFMG_TF_GLUE_REGISTER "tfmg_tf_glue_register"
#define TFMG_TF_GLUE_FILE "libtfmg_tf.so"

#endif  // TFMG_TF_GLUE_H_
