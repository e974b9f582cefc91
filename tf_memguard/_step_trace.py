"""One training step as the pool saw it (StepTrace), and the flags and ops of its trace.

The pool's trace of a step is its allocation events, in order, with each block's size,
what asked for it (its kind, KINDS) and, while profiling, whether its first dimension is
the batch size (TensorFlow's kernels announce their shapes; the plugin tags those
blocks). The memory model (_memory_model.StepModel) is made from such traces
(_model_build)."""
import dataclasses

import numpy as np

from tf_memguard import _core

_KIND_SHIFT = _core.ALLOC_KIND_SHIFT
_BATCH = _core.ALLOC_BATCH
_ROWS = _core.ALLOC_BATCH_ROWS
_SQUARE = _core.ALLOC_BATCH_SQUARE
_MUST = _core.ALLOC_MUST_SUCCEED
KINDS = _core.KINDS
# Trace ops (tfmg_trace_op).
_ALLOC, _FREE, _REFUSE, _OVERSHOOT = 0, 1, 2, 3


def kind_of(flags):
    return (np.asarray(flags, dtype=np.uint32) >> _KIND_SHIFT) & 15


@dataclasses.dataclass
class StepTrace:
    """One training step as the pool saw it.

    Attributes:
        batch_size: the step's batch size.
        start_size, start_flags: the blocks live when the step began (address order).
        start_address: their addresses (to pair the step's frees of them).
        op, size, address, flags: the step's events (tfmg_trace_op, bytes, address,
            TFMG_ALLOC_* flags), oldest first.
        complete: False when the step was refused partway (the events end at the refusal).
        observed_peak: the highest account (pooled bytes in use plus overshoot) measured
            over fit()'s steps at this batch size, or 0 when unknown.
        layout: the pool's layout (tf_memguard.Pool.layout()), for the replay.
    """

    batch_size: int
    start_size: np.ndarray
    start_flags: np.ndarray
    start_address: np.ndarray
    op: np.ndarray
    size: np.ndarray
    address: np.ndarray
    flags: np.ndarray
    complete: bool = True
    observed_peak: int = 0
    layout: dict = dataclasses.field(default_factory=dict)
    # True where every step allocates in the same order (PyTorch's eager steps on one
    # stream); TensorFlow's inter-op threads order a step's kernels differently each time.
    ordered: bool = False
    # The peaks (as observed_peak) of every step with a full batch of the fit() this step
    # was recorded in, oldest first (_recording.fit_steps), or () when not measured.
    step_peaks: tuple = ()
    # Per event, the thread that made it (tfmg_trace_event.thread; empty in reports saved
    # before it was recorded): for reading a step, which kernels ran beside which. The
    # replay does not use it (benchmarks/NOTES.md, "Waiting for frees").
    thread: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.uint32))

    @classmethod
    def capture_start(cls, pool):
        """The live blocks now: call at the step's start, then pool.trace_start()."""
        return pool.live_blocks()

    @classmethod
    def from_pool(cls, pool, live, batch_size, complete=True, ordered=False):
        """The step recorded since `live` was taken and the trace started."""
        t = pool.trace_arrays()
        if t["dropped"]:
            raise ValueError(f"the step's trace lost {t['dropped']} events (trace capacity too small)")
        return cls(batch_size=int(batch_size), start_size=live["size"].astype(np.uint64),
                   start_flags=live["flags"].astype(np.uint32), start_address=live["address"].astype(np.uint64),
                   op=t["op"].astype(np.uint32), size=t["size"].astype(np.uint64),
                   address=t["address"].astype(np.uint64), flags=t["flags"].astype(np.uint32),
                   complete=complete, layout=pool.layout(), ordered=ordered,
                   thread=t["thread"].astype(np.uint32))

    def footprint(self):
        """The most bytes of backing granules (the layout's page_bytes; 0: none) that the
        step's live blocks touched at once, at their recorded addresses (granule_footprint)."""
        g = int(self.layout.get("page_bytes", 0) or 0) if self.layout.get("backs_on_demand", True) else 0
        return granule_footprint(self.start_address, self.start_size, self.op, self.size, self.address, g)

    def carries_batch(self):
        """Whether a block of the step's own was tagged batch-shaped (TensorFlow's glue tags
        each kernel allocation whose first dimension is the size profiled). A step at that
        size makes its batch's activations: one without a tagged block ran another size
        (a PyDataset's batches, which fit() shuffles, put its short batch anywhere)."""
        return bool(np.any((self.op != _FREE) & ((self.flags & _BATCH) != 0)))

    def start_bytes(self, kind):
        """The bytes of `kind` (a KINDS name) live at the step's start."""
        return int(np.asarray(self.start_size)[kind_of(self.start_flags) == KINDS.index(kind)].sum())

    # -- the step as replay ops --------------------------------------------------------

    def allocations(self):
        """Indices of the events that ask for memory (allocations, overshoot, the refusal)."""
        return np.flatnonzero(self.op != _FREE)

    def granted_over(self, kind):
        """Whether a request of `kind` (a KINDS name) was granted over the budget in the step."""
        k = KINDS.index(kind)
        return bool(np.any((np.asarray(self.op) == _OVERSHOOT) & (kind_of(self.flags) == k)))

    def to_dict(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d):
        arrays = {"start_size": np.uint64, "start_flags": np.uint32, "start_address": np.uint64,
                  "op": np.uint32, "size": np.uint64, "address": np.uint64, "flags": np.uint32,
                  "thread": np.uint32}
        return cls(**{k: (np.asarray(v, dtype=arrays[k]) if k in arrays else v) for k, v in d.items()})


def granule_footprint(start_address, start_size, op, size, address, granule):
    """The most bytes of granules that live blocks touched at once over a recorded step:
    the blocks live at its start, then its events (op, size, address: tfmg_trace_op order;
    refused requests hold nothing). A pool backed on demand needs at least this much
    backed, whatever its bytes in use: a granule partly used by a small block cannot be
    given back. Granule 0 (not backed on demand): the most bytes in use.

    The granules a block covers whole are its own; the ones at its ends it can share with
    neighbours, so those are counted by how many live blocks touch them."""
    s_addr = np.asarray(start_address, dtype=np.int64)
    s_size = np.asarray(start_size, dtype=np.int64)
    op = np.asarray(op)
    keep = (op != _REFUSE) & (np.asarray(address) != 0)
    e_addr = np.asarray(address, dtype=np.int64)[keep]
    e_size = np.asarray(size, dtype=np.int64)[keep]
    sign = np.concatenate([np.ones(len(s_addr), dtype=np.int64),
                           np.where(op[keep] == _FREE, -1, 1).astype(np.int64)])
    addr = np.concatenate([s_addr, e_addr])
    nbytes = np.maximum(np.concatenate([s_size, e_size]), 1)
    # Time: every start block at 0, then each event.
    when = np.concatenate([np.zeros(len(s_addr), dtype=np.int64), np.arange(1, len(e_addr) + 1, dtype=np.int64)])
    steps = len(e_addr) + 1
    if granule <= 0:
        return int(np.cumsum(np.bincount(when, weights=sign * nbytes, minlength=steps)).max()) if len(addr) else 0
    g = int(granule)
    first, last = addr // g, (addr + nbytes - 1) // g
    inner = np.maximum(last - first - 1, 0)
    whole = np.cumsum(np.bincount(when, weights=sign * inner, minlength=steps))
    # The end granules, by how many live blocks touch each: one record per block end.
    two = last > first
    gr = np.concatenate([first, last[two]])
    t = np.concatenate([when, when[two]])
    sg = np.concatenate([sign, sign[two]])
    order = np.lexsort((t, gr))
    gr, t, sg = gr[order], t[order], sg[order]
    count = np.cumsum(sg)
    starts = np.flatnonzero(np.r_[True, gr[1:] != gr[:-1]])
    base = np.repeat(count[starts] - sg[starts], np.diff(np.r_[starts, len(gr)]))
    count = count - base          # live blocks touching the granule after each record
    before = count - sg
    change = np.where((before == 0) & (count > 0), 1, np.where((before > 0) & (count == 0), -1, 0))
    ends = np.cumsum(np.bincount(t, weights=change, minlength=steps))
    return int((whole + ends).max() * g)

