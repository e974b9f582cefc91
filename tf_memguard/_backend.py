"""Which framework allocates the tensors: the one place that knows about Keras backends.

On Keras' TensorFlow backend (the default) tensors come from TensorFlow's allocators,
which tf_memguard's TensorFlow plugin replaces. On the torch backend they come from
PyTorch's CUDA allocator, which install() replaces through
torch.cuda.memory.CUDAPluggableAllocator with tf_memguard's PyTorch glue. Nothing here
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
    """"torch" on Keras' torch backend, else "tensorflow"."""
    return "torch" if keras_backend() == "torch" else "tensorflow"


def default_device():
    """The device a budget usually goes on: "GPU:0" with PyTorch, "CPU:0" with TensorFlow."""
    return "GPU:0" if framework() == "torch" else "CPU:0"


def oom_errors():
    """The exception types the framework raises when an allocation fails."""
    if framework() == "torch":
        import torch
        return (torch.OutOfMemoryError,)
    import tensorflow as tf
    return (tf.errors.ResourceExhaustedError,)


def framework_name():
    return "PyTorch" if framework() == "torch" else "TensorFlow"


def tf_glue_path():
    """tf_memguard's TensorFlow glue (cc/tf/glue.cc), loaded by the plugin under the
    TensorFlow it was built for."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtfmg_tf.so")


def torch_glue_path():
    """tf_memguard's PyTorch glue (built when PyTorch was present at install time)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "libtfmg_torch.so")
