"""Which framework allocates the tensors: the one place that knows about Keras backends.

On Keras' TensorFlow backend (the default) tensors come from TensorFlow's allocators,
which tf_memguard's TensorFlow plugin replaces. On the torch backend they come from
PyTorch's CUDA allocator, which install() replaces through
torch.cuda.memory.CUDAPluggableAllocator with tf_memguard's PyTorch glue. On the JAX
backend they come from XLA's allocator, which cannot be replaced: install() sets its cap
(_xla). Nothing here
imports TensorFlow or PyTorch unless that backend is the one in use.
"""
import os


def keras_backend():
    """The Keras backend in use ("tensorflow", "torch", "jax", ...), or None without Keras.

    Keras decides it (the KERAS_BACKEND variable, then ~/.keras/keras.json) when it is
    first imported; this imports Keras, which imports that backend.
    """
    try:
        import keras
    except ImportError:
        return None
    return keras.config.backend()


def framework():
    """"torch" or "jax" on those Keras backends, else "tensorflow"."""
    backend = keras_backend()
    return backend if backend in ("torch", "jax") else "tensorflow"


def default_device():
    """The device a budget usually goes on: "GPU:0" with PyTorch, "CPU:0" with TensorFlow,
    on JAX "GPU:0" where jaxlib has a GPU to use, else "CPU:0"."""
    fw = framework()
    if fw == "jax":
        from tf_memguard import _xla
        return _xla.default_device()
    return "GPU:0" if fw == "torch" else "CPU:0"


def oom_errors():
    """The exception types the framework raises when an allocation fails."""
    if framework() == "torch":
        import torch
        return (torch.OutOfMemoryError,)
    if framework() == "jax":
        import jax
        return (jax.errors.JaxRuntimeError,)
    import tensorflow as tf
    return (tf.errors.ResourceExhaustedError,)


def require_keras3_model(model, what):
    """Raises TypeError, saying what to do, when `model` is not a Keras 3 model: a tf_keras
    (Keras 2) model, as tf.keras makes with TF_USE_LEGACY_KERAS=1, or anything else.
    MemGuardCallback and find_batch_size read Keras 3's fit(); under tf_keras the
    callback failed with "'MemGuardCallback' object has no attribute
    '_implements_train_batch_hooks'". install()'s budget holds for any TensorFlow
    tensors, tf_keras' included."""
    import keras
    if isinstance(model, keras.Model):
        return
    module = type(model).__module__
    if module.split(".")[0] == "tf_keras":
        raise TypeError(f"tf_memguard: {what} works with Keras 3 models (the `keras` package), and this is a "
                        "tf_keras (Keras 2) model, as tf.keras makes with TF_USE_LEGACY_KERAS=1. The budget of "
                        "tf_memguard.install() holds for it all the same, and tf_memguard.report() reports the "
                        "pool (the last refused request among it); for the per-epoch peaks and the advice, build "
                        "the model with `import keras` (Keras 3) instead of tf.keras with TF_USE_LEGACY_KERAS=1.")
    raise TypeError(f"tf_memguard: {what} takes a Keras 3 model (keras.Model), not "
                    f"{module}.{type(model).__name__}")


def framework_name():
    return {"torch": "PyTorch", "jax": "JAX"}.get(framework(), "TensorFlow")


def tf_glue_path():
    """tf_memguard's TensorFlow glue (cc/tf/glue.cc), loaded by the plugin under the
    TensorFlow it was built for."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtfmg_tf.so")


def torch_glue_path():
    """tf_memguard's PyTorch glue (built when PyTorch was present at install time)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtfmg_torch.so")
