"""Keras' JAX backend: XLA's own cap on its GPU allocator, and its statistics.

XLA's allocator cannot be replaced from a library (the PJRT GPU client builds its
allocators in: bfc, platform, cuda_async, vmm), so on JAX install() sets the cap XLA reads
when its backend starts: the BFC allocator's limit, `XLA_CLIENT_MEM_FRACTION` of the GPU's
memory (jaxlib/xla_client.py, generate_pjrt_gpu_plugin_options), preallocated (XLA's
default; `XLA_PYTHON_CLIENT_PREALLOCATE` is left as the user set it): the process takes
its slice whole when JAX starts. The fraction is one number for every GPU of the process. Measured on an H200
(benchmarks/results/probe_jax_h200.json): 1 GiB asked gave bytes_limit 1,073,741,824;
3 GiB gave 3 GiB + 2 MiB, so the budget tf_memguard states and checks against is the
bytes_limit XLA reports, never more than asked plus that rounding.

XLA's CPU client has no cap and no statistics (memory_stats() is None): on CPU the budget
is tf_memguard's own, checked against each compiled step's memory before it runs
(_xla_run), not a limit on allocations.
"""
import ctypes
import os
import sys

from tf_memguard._units import format_bytes

FRACTION_VARS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
_asked = {}  # device -> bytes asked for, for the check once the backend has started


def backend_started():
    """True once JAX has made its backends (the allocator settings are read then)."""
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())


def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def gpu_count():
    """GPUs the CUDA driver sees (0 without a driver), without starting JAX or a context."""
    cuda = _libcuda()
    if cuda is None or cuda.cuInit(0) != 0:
        return 0
    n = ctypes.c_int()
    return n.value if cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


def gpu_total_memory(index):
    """The memory of GPU `index` (cuDeviceTotalMem: no context is made)."""
    cuda = _libcuda()
    if cuda is None or cuda.cuInit(0) != 0:
        raise RuntimeError("no CUDA driver (libcuda.so.1): JAX's GPU backend cannot run here; use device='CPU:0'")
    dev, total = ctypes.c_int(), ctypes.c_size_t()
    if cuda.cuDeviceGet(ctypes.byref(dev), index) != 0:
        raise RuntimeError(f"device='GPU:{index}': the CUDA driver sees {gpu_count()} GPU(s)")
    if cuda.cuDeviceTotalMem_v2(ctypes.byref(total), dev) != 0:
        raise RuntimeError(f"device='GPU:{index}': cuDeviceTotalMem failed")
    return total.value


def default_device():
    """"GPU:0" where the driver sees a GPU and jaxlib has its CUDA plugin, else "CPU:0"."""
    import importlib.util

    def present(name):
        try:
            return importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # "jax_plugins.x" without jax_plugins
            return False
    plugin = any(present(name) for name in ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                                            "jax_plugins.xla_cuda12"))
    return "GPU:0" if plugin and gpu_count() else "CPU:0"


def host_total_memory():
    from tf_memguard import _core
    return _core.Pool(max_bytes=1 << 20).total_memory()


def set_cap(device, max_bytes, total):
    """Makes XLA cap its GPU allocator at `max_bytes` of `total` when its backend starts.

    Raises RuntimeError when it has started (the settings were read) or when the
    environment asks for an allocator XLA does not cap."""
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default").strip().lower()
    if allocator not in ("default", "bfc"):
        raise RuntimeError(
            f"XLA_PYTHON_CLIENT_ALLOCATOR={allocator} makes XLA use an allocator without its memory cap, so a "
            "budget would not be enforced. Unset it (or set it to 'bfc') before starting Python.")
    if backend_started():
        previous = _asked.get(device)
        if previous == max_bytes:
            return
        raise RuntimeError(
            "JAX has already started its backend (an array was made, or jax.devices() was called), and XLA "
            "reads its memory cap only then. Call tf_memguard.install() first, before anything touches JAX "
            "(right after `import keras` is fine), or start Python with XLA_CLIENT_MEM_FRACTION="
            f"{max_bytes / total:.6f} in the environment.")
    fraction = max_bytes / total
    for name in FRACTION_VARS:  # jaxlib refuses both at once
        os.environ.pop(name, None)
    os.environ["XLA_CLIENT_MEM_FRACTION"] = repr(fraction)
    # Preallocated, the slice is one region from the start: a step's temporaries (one
    # buffer) find room in it. Grown on demand, XLA's regions count against the cap as they
    # are made and a large buffer needs a new one: on the H200 a step whose temporaries were
    # 1.85 GiB ran out under a 2 GiB cap with 1.39 GB in use at most (NOTES).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    _asked.clear()
    _asked[device] = max_bytes


def jax_device(device):
    import jax
    kind, index = device.split(":")
    try:
        return jax.devices("gpu" if kind == "GPU" else "cpu")[int(index)]
    except (RuntimeError, IndexError) as e:
        raise RuntimeError(f"device={device!r}: JAX has no such device ({e})") from None


def memory_stats(device):
    """XLA's statistics of `device` (bytes_in_use, peak_bytes_in_use since the process
    started, bytes_limit, largest_free_block_bytes, ...), or None (XLA's CPU client)."""
    return jax_device(device).memory_stats()


def cap(device, asked):
    """The cap XLA enforces on `device` (its bytes_limit), or None where it has none.

    Raises RuntimeError when XLA's limit is not the one install() asked for: the backend
    started before install(), or another setting won."""
    stats = memory_stats(device)
    if not stats or "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    # XLA rounds the fraction's bytes up to its own granularity: 2 MiB was seen (3 GiB -> 3 GiB + 2 MiB).
    if asked and not (asked - (4 << 20) <= limit <= asked + (4 << 20)):
        raise RuntimeError(
            f"device={device!r}: XLA's allocator limit is {format_bytes(limit)}, not the {format_bytes(asked)} "
            "tf_memguard.install() asked for: JAX started its backend before install() (or XLA_CLIENT_MEM_FRACTION "
            "was changed). Call install() before anything touches JAX.")
    return limit


def is_oom(error):
    """True for XLA's out-of-memory error (RESOURCE_EXHAUSTED), at run or compile time."""
    return "RESOURCE_EXHAUSTED" in str(error) or "Out of memory" in str(error)
