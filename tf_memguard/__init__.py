"""tf_memguard: a hard memory budget for Keras/TensorFlow.

    import tf_memguard
    tf_memguard.install(max_bytes="2GiB")   # before building the model

From then on TensorFlow's CPU tensors come out of tf_memguard's pool, which never
reserves more than the budget. stats() reads the pool's statistics (TensorFlow's field
names), last_refusal() the state at the last request that did not fit.

The native pool is also available directly as :class:`Pool` (host memory, a budget,
best-fit allocation with splitting and coalescing), for tests, benchmarks and tools.
"""
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
from tf_memguard._units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "Config",
    "DoubleFreeError",
    "OutOfBudgetError",
    "Pool",
    "PoolError",
    "UnknownPointerError",
    "config",
    "device_pool",
    "format_bytes",
    "install",
    "last_refusal",
    "parse_bytes",
    "reset_peak",
    "stats",
]
