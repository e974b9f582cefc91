"""tf_memguard: a hard memory budget for Keras/TensorFlow.

The native pool is available directly as :class:`Pool` (host memory, a budget, best-fit
allocation with splitting and coalescing), for tests, benchmarks and tools.
"""
from tf_memguard._core import (
    DoubleFreeError,
    OutOfBudgetError,
    Pool,
    PoolError,
    UnknownPointerError,
)

__version__ = "0.1.0"

__all__ = [
    "DoubleFreeError",
    "OutOfBudgetError",
    "Pool",
    "PoolError",
    "UnknownPointerError",
]
