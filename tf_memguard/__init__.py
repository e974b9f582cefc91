"""tf_memguard: a hard memory budget for Keras/TensorFlow.

    import tf_memguard
    tf_memguard.install(max_bytes="2GiB")   # before building the model
    model.fit(x, y, callbacks=[tf_memguard.MemGuardCallback()])
    print(tf_memguard.report())

From then on TensorFlow's CPU tensors come out of tf_memguard's pool, which never
reserves more than the budget. stats() reads the pool's statistics (TensorFlow's field
names), last_refusal() the state at the last request that did not fit.

The native pool is also available directly as :class:`Pool` (host memory, a budget,
best-fit allocation with splitting and coalescing), for tests, benchmarks and tools.

Imported before TensorFlow, it turns TensorFlow's oneDNN kernels off (TF_ENABLE_ONEDNN_OPTS=0,
unless the environment already says): they crash when an allocation is refused, so with
them on the budget could not be hard (tf_memguard/_onednn.py).
"""
from tf_memguard import _onednn

_onednn.choose_at_import()  # before anything below can import TensorFlow
from tf_memguard._core import (
    DoubleFreeError,
    OutOfBudgetError,
    Pool,
    PoolError,
    UnknownPointerError,
)
from tf_memguard._install import (
    Config,
    config,
    device_pool,
    install,
    last_refusal,
    reset_peak,
    stats,
)
from tf_memguard._find import find_batch_size
from tf_memguard._report import Report, report
from tf_memguard._units import format_bytes, parse_bytes

__version__ = "0.1.0"


def __getattr__(name):
    # The callback needs Keras and TensorFlow; importing them is deferred to first use
    # so that `import tf_memguard` stays light.
    if name == "MemGuardCallback":
        from tf_memguard import _callback
        return _callback.MemGuardCallback
    if name == "BudgetExceededError":
        from tf_memguard import _errors
        return _errors.budget_exceeded_error()
    raise AttributeError(f"module 'tf_memguard' has no attribute {name!r}")


__all__ = [
    "BudgetExceededError",
    "Config",
    "MemGuardCallback",
    "Report",
    "DoubleFreeError",
    "OutOfBudgetError",
    "Pool",
    "PoolError",
    "UnknownPointerError",
    "config",
    "device_pool",
    "find_batch_size",
    "format_bytes",
    "install",
    "last_refusal",
    "parse_bytes",
    "report",
    "reset_peak",
    "stats",
]
