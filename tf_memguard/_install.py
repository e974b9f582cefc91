"""install(): give the framework's tensors a hard budget, through the core's pool.

TensorFlow (Keras' default backend): CPU:0 through the TensorFlow plugin, GPU:<n>
through its GPUProcessState hook. PyTorch (Keras' torch backend): GPU:<n> ("cuda:<n>")
through torch.cuda.memory.CUDAPluggableAllocator and tf_memguard's PyTorch glue.
"""
import dataclasses
import os
import re
import threading

from tf_memguard import _backend, _core, _onednn
from tf_memguard._units import HELP, format_bytes, parse_bytes

_lock = threading.Lock()
_configs = {}  # device -> Config
_torch_allocator = []  # the CUDAPluggableAllocator installed in PyTorch (kept alive), if any


@dataclasses.dataclass(frozen=True)
class Config:
    """The budget in force on a device, as returned by install() and config().

    Attributes:
        device: "CPU:0".
        max_bytes: the budget in bytes.
        requested: what was passed as max_bytes ("6GB", 0.5, ...).
        predating_bytes: bytes TensorFlow had allocated on the device before the first
            install() (not under the budget; freed normally later).
        total_memory: the device's memory (host: physical memory, or the cgroup limit).
        plugin_path: the library that routes tensors to the pool (the TensorFlow plugin,
            or the PyTorch glue).
        framework: "tensorflow", "torch" or "jax": whose tensors the budget holds.
        wait: seconds without a block freed after which a kernel's request that does not
            fit is refused (0: at once; only TensorFlow's requests wait).
    """

    device: str
    max_bytes: int
    requested: object
    predating_bytes: int
    total_memory: int
    plugin_path: str
    framework: str = "tensorflow"
    wait: float = 0.0

    @property
    def enforced(self):
        """True where the budget is a limit on allocations: always, but on JAX's CPU
        client, which has no cap (there each step's compiled size is checked before it runs)."""
        return not (self.framework == "jax" and self.device == "CPU:0")

    @property
    def serving(self):
        """True once the framework takes its tensors' memory from tf_memguard's pool (on
        JAX: XLA's allocator under its cap, or the compiled-step check on CPU)."""
        if self.framework == "jax":
            return True
        if self.framework == "torch":
            return bool(_torch_allocator)
        return bool(_core.plugin_state() & _core.PLUGIN_SERVING)

    def __str__(self):
        return (f"{self.device}: budget {format_bytes(self.max_bytes)} ({self.max_bytes} bytes) "
                f"of {format_bytes(self.total_memory)}")


def normalize_device(device):
    """'CPU:0', 'cpu', '/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:0' -> 'CPU:0'."""
    if not isinstance(device, str):
        raise ValueError(f"device={device!r}: must be a string such as 'CPU:0'")
    m = re.fullmatch(r"(?:.*/)?(?:device:)?([A-Za-z]+)(?::(\d+))?", device.strip())
    if not m:
        raise ValueError(f"device={device!r}: must look like 'CPU:0'")
    kind, index = m.group(1).upper(), int(m.group(2) or 0)
    if kind == "CPU":
        if index != 0:
            raise ValueError(f"device={device!r}: TensorFlow has one CPU allocator; use 'CPU:0'")
        return "CPU:0"
    if kind in ("GPU", "CUDA"):
        return f"GPU:{index}"
    raise ValueError(f"device={device!r}: unknown device type {kind!r}; use 'CPU:0' or 'GPU:0'")


def _env_true(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _check_plugin():
    """Import TensorFlow (which loads the plugin) and check that tensors will reach the pool."""
    import tensorflow  # noqa: F401  (loads site-packages/tensorflow-plugins/)

    state = _core.plugin_state()
    if state & (_core.PLUGIN_MISMATCH | _core.PLUGIN_GLUE_FAILED):
        # The words the plugin warned with at `import tensorflow`.
        raise RuntimeError("tf_memguard: " + _core.plugin_message())
    if state & _core.PLUGIN_DISABLED:
        raise RuntimeError("tf_memguard's TensorFlow plugin is turned off (TF_MEMGUARD_DISABLE=1 in the "
                           "environment), so no budget can be enforced. Unset it and restart Python.")
    if not state & _core.PLUGIN_LOADED:
        raise RuntimeError(
            "tf_memguard's TensorFlow plugin was not loaded by `import tensorflow` (no "
            "libtf_memguard_plugin.so in a site-packages/tensorflow-plugins/ folder, or it was built "
            "without TensorFlow). Install TensorFlow first, then reinstall tf_memguard: "
            "pip install tensorflow-cpu==2.21.0 && pip install --force-reinstall --no-deps tf_memguard")
    if not state & _core.PLUGIN_REGISTERED:
        raise RuntimeError("tf_memguard's TensorFlow plugin loaded but did not register its allocator "
                           "(see the warning it printed at `import tensorflow`).")
    if _env_true("TF_CPU_ALLOCATOR_USE_BFC"):
        raise RuntimeError(
            "TF_CPU_ALLOCATOR_USE_BFC=true makes TensorFlow use its own BFC allocator on the CPU and "
            "bypass tf_memguard, so a budget would not be enforced. Unset it before starting Python.")
    _onednn.check_install()


def not_serving(device=None):
    """Why MemGuardCallback would record nothing on `device` (the pool does not see the
    framework's tensors), or None when it does."""
    if _backend.framework() == "torch":
        device = resolve_device(device)
        if _core.find_device_pool(device) is None:
            return (f"MemGuardCallback records nothing on {device}: on Keras' torch backend the tensors are in "
                    f"tf_memguard's pool only after tf_memguard.install(max_bytes, device={device!r}), called "
                    "before the model is built")
        return None
    if _backend.framework() != "tensorflow":
        return None
    import tensorflow  # noqa: F401  (the plugin is loaded by it)
    state = _core.plugin_state()
    if state & _core.PLUGIN_DISABLED:
        return ("tf_memguard's TensorFlow plugin is turned off (TF_MEMGUARD_DISABLE=1): MemGuardCallback records "
                "nothing. Unset it and restart Python to measure memory.")
    if state & (_core.PLUGIN_MISMATCH | _core.PLUGIN_GLUE_FAILED):
        return "MemGuardCallback records nothing: " + _core.plugin_message()
    if not state & _core.PLUGIN_REGISTERED:
        return ("tf_memguard's TensorFlow plugin is not registered (see its warning at `import tensorflow`): "
                "MemGuardCallback records nothing.")
    return None


def device_pool(device=None):
    """The process-wide pool of `device`, shared with the framework (a tf_memguard.Pool).

    CPU:0 always has one (counting, before install()); a GPU has one after
    install(device="GPU:<n>"). Not on Keras' JAX backend (XLA keeps its own allocator)."""
    device = resolve_device(device)
    if _backend.framework() == "jax":
        raise RuntimeError("on Keras' JAX backend tensors live in XLA's allocator, not in a tf_memguard pool: "
                           "tf_memguard.stats() gives XLA's statistics, MemGuardCallback the peaks and advice")
    if device == "CPU:0":
        return _core.device_pool(device)
    pool = _core.find_device_pool(device)
    if pool is None:
        raise RuntimeError(f"device={device!r}: no pool yet; call tf_memguard.install(max_bytes, device={device!r})")
    return pool


def _gpu_pool(device):
    """Creates the pool of GPU:<n> over CUDA memory, for TensorFlow's GPU allocator hook."""
    import tensorflow as tf

    if not _core.plugin_state() & _core.PLUGIN_GPU_HOOK:
        if not _env_true("TF_MEMGUARD_GPU"):
            raise RuntimeError(
                f"device={device!r}: tf_memguard's GPU allocator hook is off, so TensorFlow keeps its own GPU "
                "allocator. It is installed only when asked for: start Python with TF_MEMGUARD_GPU=1 in the "
                "environment (read at `import tensorflow`), then call install(device=...) before the first op.")
        raise RuntimeError("tf_memguard's GPU allocator hook is not installed in this TensorFlow (another "
                           "GPUProcessState was created first), so a GPU budget cannot be enforced.")
    index = int(device.split(":")[1])
    gpus = tf.config.list_physical_devices("GPU")
    if index >= len(gpus):
        raise RuntimeError(f"device={device!r}: TensorFlow sees {len(gpus)} GPU(s) (tensorflow-cpu has no CUDA "
                           "support); install a CUDA build of TensorFlow, or use 'CPU:0'")
    try:
        return _core.configure_device_pool(device, "cuda", index)
    except (MemoryError, RuntimeError) as e:
        raise RuntimeError(f"device={device!r}: {e}") from None


# What to do for a budget on the CPU where Keras runs on PyTorch (its CPU allocator has no hook).
_CPU_ON_TORCH = ("For a budget on the CPU, run Keras on its TensorFlow backend (KERAS_BACKEND=tensorflow, with "
                 "tensorflow-cpu installed before tf_memguard), whose CPU allocator tf_memguard replaces.")


def _torch_pool(device):
    """Creates the pool of GPU:<n> over CUDA memory and makes PyTorch allocate from it."""
    if device == "CPU:0":
        raise ValueError("device='CPU:0': on Keras' torch backend tf_memguard budgets CUDA memory "
                         "(PyTorch's CPU allocator cannot be replaced); use device='cuda:0'. " + _CPU_ON_TORCH)
    import torch

    index = int(device.split(":")[1])
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device!r}: PyTorch {torch.__version__} sees "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)"
                           + ("" if torch.version.cuda else " (a CPU-only build of PyTorch)")
                           + ". On Keras' torch backend tf_memguard budgets a GPU's memory. " + _CPU_ON_TORCH)
    glue = _backend.torch_glue_path()
    if not os.path.exists(glue):
        raise RuntimeError("tf_memguard was installed without its PyTorch glue (PyTorch was not in the "
                           "environment then). Reinstall it now that torch is there: "
                           "pip install --force-reinstall --no-deps tf_memguard")
    try:
        pool = _core.configure_device_pool(device, "cuda", index)
    except (MemoryError, RuntimeError) as e:
        raise RuntimeError(f"device={device!r}: {e}") from None
    if not _torch_allocator:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(glue, "tfmg_torch_malloc", "tfmg_torch_free")
        try:
            torch.cuda.memory.change_current_allocator(allocator)
        except RuntimeError as e:
            raise RuntimeError(
                "PyTorch has set up its CUDA allocator already (a CUDA tensor was made, or torch.cuda "
                "was initialized), and it cannot be swapped afterwards: call tf_memguard.install() "
                f"first, before anything touches CUDA ({e})") from None
        _torch_allocator.append(allocator)
    return pool


def _install_xla(max_bytes, device):
    """Keras' JAX backend: XLA's cap on a GPU, the compiled-step check on the CPU."""
    import warnings

    from tf_memguard import _xla
    if device == "CPU:0":
        total = _xla.host_total_memory()
        n = parse_bytes(max_bytes, total)
        if ("CPU:0", "jax") not in _warned_xla:
            _warned_xla.add(("CPU:0", "jax"))
            warnings.warn(
                "tf_memguard: XLA's CPU client has no memory cap, so on Keras' JAX backend the CPU budget is not a limit "
                f"on allocations: MemGuardCallback checks each training step's compiled size against the "
                f"{format_bytes(n)} budget before it runs (refusing a step that would not fit), reports the peaks "
                "and advises batch sizes from the compiled step.", stacklevel=3)
        path = "compiled-step check (XLA's CPU client has no cap)"
    else:
        total = _xla.gpu_total_memory(int(device.split(":")[1]))
        n = parse_bytes(max_bytes, total)
        _xla.set_cap(device, n, total)
        path = f"XLA_CLIENT_MEM_FRACTION={os.environ['XLA_CLIENT_MEM_FRACTION']}"
    with _lock:
        if device != "CPU:0":
            for other in [d for d, c in _configs.items() if c.framework == "jax" and d != "CPU:0"]:
                del _configs[other]  # one fraction for every GPU of the process
        cfg = Config(device=device, max_bytes=n, requested=max_bytes, predating_bytes=0, total_memory=total,
                     plugin_path=path, framework="jax")
        _configs[device] = cfg
    return cfg


_warned_xla = set()


# Seconds without a block freed after which a waiting request is refused (see install()).
DEFAULT_WAIT = 1.0


def _wait_seconds(wait):
    if wait is None:
        return DEFAULT_WAIT
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 3600:
        raise ValueError(f"wait={wait!r}: must be a number of seconds from 0 (refuse at once) to 3600, or None "
                         f"for the default ({DEFAULT_WAIT})")
    return float(wait)


def install(max_bytes, device=None, wait=None):
    """Puts the tensors of `device` under a hard budget of `max_bytes`.

    Call it before building the model. From then on every tensor the framework allocates
    on the device comes out of tf_memguard's pool, which never reserves more than the
    budget.

    On TensorFlow (Keras' default backend) a kernel's request that does not fit fails
    with TensorFlow's ResourceExhaustedError (the process, the model and its weights stay
    usable), and requests TensorFlow cannot survive a refusal of (numpy or Python values
    turned into tensors, XLA buffers) are granted and counted as overshoot in stats().

    On Keras' JAX backend (KERAS_BACKEND=jax), whose allocator (XLA's) cannot be
    replaced, a GPU budget is XLA's own cap (XLA_CLIENT_MEM_FRACTION of the GPU, taken
    whole when JAX starts), read when JAX starts its backend: call install() before anything
    touches JAX; the same cap holds on every GPU of the process. XLA's CPU client has no
    cap: on device="CPU:0" the budget is checked against each training step's compiled
    size before it runs (MemGuardCallback), which install() says in a warning.

    On Keras' torch backend (KERAS_BACKEND=torch) the device is a GPU ("cuda:0"):
    PyTorch's CUDA allocator is replaced through
    torch.cuda.memory.CUDAPluggableAllocator, so install() must come before anything
    touches CUDA; a request that does not fit raises torch.OutOfMemoryError with the
    pool's explanation, and the process goes on. The pool maps device memory as blocks
    are handed out (CUDA virtual memory), so stats()["bytes_reserved"] follows what the
    run needed, never above the budget. Other GPUs are served too, counted, without a
    budget.

    Near the budget, a TensorFlow kernel's request that does not fit first waits for
    blocks that the kernels running on other threads free (TensorFlow runs a step's
    kernels on several threads, in an order drawn anew in every process, so the same
    step can peak higher in one process than in the next); it is refused only once no
    block was freed for `wait` seconds, and a step that does not fit then fails without
    further waits. TensorFlow's own BFC allocator waits the same way (up to 10 s).

    Calling it again changes the budget (raising it always works; lowering it below what
    the pool holds in regions with live tensors raises OutOfBudgetError and keeps the old
    one). Tensors allocated before the first install() are not under the budget; the
    report says how much that was (Config.predating_bytes).

    Args:
        max_bytes: the budget: an int (bytes), a float in (0, 1] (a fraction of the
            device's memory: for the host, physical memory or the cgroup limit if lower),
            or a string such as "6GB", "512MiB" or "50%".
        device: "CPU:0", or "GPU:<n>" / "cuda:<n>" (a fraction is then of that GPU's
            memory; call install() before the framework sets up the GPU, i.e. before the
            first op or model). Defaults to "CPU:0" on TensorFlow, "GPU:0" on torch.
        wait: seconds a TensorFlow kernel's request that does not fit waits without any
            block freed before it is refused; 0 refuses at once. Defaults to
            DEFAULT_WAIT (1 s). Requests on Keras' torch backend never wait (one
            thread allocates there, and nothing else would free).

    Returns:
        The Config in force.

    Raises:
        ValueError: a bad max_bytes or device, naming the value.
        RuntimeError: the framework would bypass the pool (plugin or glue missing or
            turned off, TF_CPU_ALLOCATOR_USE_BFC=true, PyTorch's CUDA allocator already
            set up), or TensorFlow was imported before tf_memguard with its oneDNN
            kernels on (their requests cannot be refused; TF_ENABLE_ONEDNN_OPTS=1 asked
            for explicitly only warns); the message says what to do.

    Example:
        >>> import tf_memguard
        >>> tf_memguard.install(max_bytes="2GiB")
    """
    framework = _backend.framework()
    device = normalize_device(device if device is not None else _backend.default_device())
    parse_bytes(max_bytes, 1 << 40)  # a bad value fails before anything is set up
    wait_s = _wait_seconds(wait)
    if framework == "jax":
        return _install_xla(max_bytes, device)
    if framework == "torch":
        pool = _torch_pool(device)
        path = _backend.torch_glue_path()
    else:
        _check_plugin()
        pool = _core.device_pool(device) if device == "CPU:0" else _gpu_pool(device)
        path = _core.plugin_path()
    total = pool.total_memory()
    n = parse_bytes(max_bytes, total)
    with _lock:
        previous = _configs.get(device)
        predating = previous.predating_bytes if previous else pool.stats()["passthrough_bytes_in_use"]
        pool.set_limit(n)
        pool.set_wait(wait_s if framework == "tensorflow" else 0.0)
        cfg = Config(device=device, max_bytes=n, requested=max_bytes, predating_bytes=predating,
                     total_memory=total, plugin_path=path, framework=framework,
                     wait=wait_s if framework == "tensorflow" else 0.0)
        _configs[device] = cfg
    return cfg


def resolve_device(device):
    """`device` normalized; None: the one device install() was called for, else the
    framework's usual one ("CPU:0" on TensorFlow, "GPU:0" on torch)."""
    if device is None:
        installed = list(_configs)
        return installed[0] if len(installed) == 1 else normalize_device(_backend.default_device())
    return normalize_device(device)


def config(device=None):
    """The Config in force on `device`, or None before install()."""
    return _configs.get(resolve_device(device))


def waits_off():
    """True where a budget on TensorFlow's tensors was installed with wait=0: its kernels'
    requests are refused at once, and no wait absorbs an order of the kernels that a
    recorded step did not show (see _advice.NO_WAIT_CAVEAT)."""
    return any(c.framework == "tensorflow" and c.wait == 0 for c in list(_configs.values()))


def stats(device=None):
    """The pool's statistics for `device` as a dict (TensorFlow's field names and more).

    Works with and without install(): without it, the pool passes allocations through
    to host memory and still counts them. On Keras' JAX backend: XLA's own statistics
    (bytes_in_use, peak_bytes_in_use since the process started, bytes_limit,
    largest_free_block_bytes, ...); XLA's CPU client keeps none (RuntimeError).
    """
    if _backend.framework() == "jax":
        from tf_memguard import _xla
        device = resolve_device(device)
        s = _xla.memory_stats(device)
        if s is None:
            raise RuntimeError(f"device={device!r}: XLA's CPU client keeps no memory statistics; MemGuardCallback's "
                               "logs and report give each epoch's peak from the compiled step")
        return dict(s)
    return device_pool(device).stats()


def last_refusal(device=None):
    """The state at the most recent refused request on `device` (a dict), or None."""
    return device_pool(device).last_refusal()


def reset_peak(device=None):
    """Starts a new window for stats()["window_peak_bytes_in_use"] (e.g. per epoch)."""
    device_pool(device).reset_peak()


__all__ = ["Config", "DEFAULT_WAIT", "HELP", "config", "device_pool", "install", "last_refusal", "reset_peak",
           "resolve_device", "stats"]
