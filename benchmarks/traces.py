"""Allocation traces shared by the benchmarks: fixed seeds, generated with NumPy.

A trace is three arrays of one length: ``sizes`` (bytes to allocate; 0 for frees),
``slots`` (where the allocation's pointer is kept, or which pointer to free) and
``is_free``; plus ``nslots`` and ``peak_live_bytes`` (the largest sum of requested bytes
live at once). The native replayers (``tf_memguard._core.replay_pool`` and
``replay_system``) run them without Python in the timed loop.
"""
import dataclasses

import numpy as np

KiB = 1 << 10
MiB = 1 << 20


@dataclasses.dataclass
class Trace:
    name: str
    sizes: np.ndarray
    slots: np.ndarray
    is_free: np.ndarray
    nslots: int
    peak_live_bytes: int
    description: str

    @property
    def ops(self):
        return len(self.sizes)


def pairs(name, size, ops=200_000):
    """Allocate and immediately free one block of `size`, ops/2 times."""
    n = ops // 2
    sizes = np.zeros(2 * n, dtype=np.uint64)
    sizes[0::2] = size
    is_free = np.zeros(2 * n, dtype=np.uint32)
    is_free[1::2] = 1
    slots = np.zeros(2 * n, dtype=np.uint32)
    return Trace(name, sizes, slots, is_free, 1, size, f"alloc/free pairs of {size} B")


def churn(name, max_live, lo, hi, ops=200_000, seed=0):
    """Random churn: fill up to `max_live` blocks, then allocate or free (a random live
    block) with equal odds, never above `max_live`. Sizes log-uniform in [lo, hi]."""
    rng = np.random.default_rng(seed)
    log_sizes = rng.uniform(np.log(lo), np.log(hi), size=ops)
    all_sizes = np.exp(log_sizes).astype(np.uint64)
    coins = rng.random(ops)
    picks = rng.random(ops)
    sizes = np.zeros(ops, dtype=np.uint64)
    slots = np.zeros(ops, dtype=np.uint32)
    is_free = np.zeros(ops, dtype=np.uint32)
    live = []           # slot ids of live blocks
    live_size = {}      # slot -> size
    free_slots = list(range(max_live - 1, -1, -1))
    live_bytes = peak = 0
    filling = True
    for i in range(ops):
        if filling and len(live) == max_live:
            filling = False
        do_alloc = (not live) or (len(live) < max_live and (filling or coins[i] < 0.5))
        if do_alloc:
            slot = free_slots.pop()
            size = int(all_sizes[i])
            sizes[i] = size
            slots[i] = slot
            live.append(slot)
            live_size[slot] = size
            live_bytes += size
            peak = max(peak, live_bytes)
        else:
            k = int(picks[i] * len(live))
            slot = live[k]
            live[k] = live[-1]
            live.pop()
            slots[i] = slot
            is_free[i] = 1
            live_bytes -= live_size.pop(slot)
            free_slots.append(slot)
    desc = f"churn, at most {max_live} live, sizes log-uniform {lo} B - {hi // KiB} KiB"
    return Trace(name, sizes, slots, is_free, max_live, peak, desc)


# The churn kinds of standard_traces(): (name, most blocks live, largest size).
CHURN_KINDS = (("churn_100", 100, 8 * MiB), ("churn_2000", 2000, 8 * MiB), ("churn_10000", 10000, 1 * MiB))


def standard_traces():
    """The traces of benchmarks/alloc_latency.py (and the GPU proof)."""
    return [
        pairs("pairs_512", 512),
        pairs("pairs_64k", 64 * KiB),
        pairs("pairs_4m", 4 * MiB),
        churn("churn_100", 100, 256, 8 * MiB, seed=100),
        churn("churn_2000", 2000, 256, 8 * MiB, seed=2000),
        churn("churn_10000", 10000, 256, 1 * MiB, seed=10000),
    ]
