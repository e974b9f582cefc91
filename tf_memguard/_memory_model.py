"""A model of one training step's memory: does batch size B fit budget M?

What the pool sees of a step is its allocation events, in order, with each block's size,
what asked for it (its kind) and, while profiling, whether its first dimension is the
batch size (TensorFlow's kernels announce their shapes; the plugin tags those blocks).
Here every block becomes a line in the batch size:

- a block tagged batch-shaped is proportional to the batch (exact for a tensor whose
  first dimension is the batch); so is one whose first dimension is a multiple of the
  batch (a batch-shaped tensor flattened), where the second step confirms it;
- an untagged block is matched against a second recorded step at another batch size:
  the same size in both is fixed (weights' gradients, optimizer updates, workspaces of
  a fixed size); blocks that changed are paired by rank within their kind, and their
  line goes through both sizes;
- a block left without a partner is only known to lie between fixed and proportional:
  the model takes whichever needs more at the size asked about (proportional above the
  recorded size, fixed below it).

To ask whether B fits M, the step scaled to B is replayed through the pool's own code
(tfmg_replay_step: the same best fit, placement, granule backing and budget account,
on bookkeeping alone), starting from the blocks live at the step's start (weights,
optimizer slots, Keras' copy of the data, batches prepared ahead). The largest B that
fits is a bisection of replays. What one recorded step cannot show, how much higher
other steps of the same run peak (which prepared batches meet a step's peak is thread
timing), is measured as the `spread`: the highest peak fit() showed at the recorded size
less the replay's own peak there, kept free in every replay (the template is the highest
of the steps recorded, so the spread covers only steps that were not). What the recorded
order of allocations cannot show either is another order's layout: where the pool backs
memory in granules (64 KiB on host, 2 MiB on a GPU), a large block (placed at the low end,
apart from the small ones packed at the top) can leave a granule at its end partly used
that no neighbour shares, so each large block live at the step's peak is allowed one
granule more than the replay gave it (the README's CNN at 233 samples under 128 MiB:
14 such blocks, 0.9 MiB; the replay's own order fitted with 0.3 MiB to spare, and one run
of two ran out by a granule), and at least LAYOUT_SLACK of the budget is kept free for
the fragmentation of a long run's pool, which a replay from the step's start cannot show.
"""
import dataclasses

import numpy as np

from tf_memguard import _core, _epoch

_KIND_SHIFT = _core.ALLOC_KIND_SHIFT
# The share of the budget a replay keeps free for the layout a long run leaves: a replay
# starts from the blocks live at the step's start, packed, where a run's pool has been
# through thousands of steps, and many small blocks (recurrent models' time steps) leave
# granules partly used. Measured at the edge (benchmarks/NOTES.md, "The layout a run
# leaves"): runs that ran out at sizes whose replay fitted needed 0.4-1.7% of the budget
# more (the zoo's BiLSTM under 48 MiB: 0.8 MiB, its GRU under 72 MiB: 0.5 MiB, the
# README's CNN under 128 MiB: 0.6 MiB).
LAYOUT_SLACK = 0.02
# How much the peaks of one batch size differ from process to process, as a share of what
# the step's own bytes grew by from a batch of 1: the order TensorFlow's threads run the
# kernels in is drawn anew in each process and moves with the kernels' timing. The zoo's
# ResNet at 300 peaked at 380.5 and 404.5 MiB in three processes (24 MiB: 6.3% of its
# step's growth, about 380 MiB); keras.io's text CNN at 277 peaked 11.6 MiB above its
# usual steps every few steps (6.7% of its steady step's 174 MiB of growth; measured as
# 6% of the whole step at first, and 1/16 kept, which its find_batch_size's 260 ran out
# through). The largest share measured, rounded up to a unit fraction. Kept free for
# orders not met (StepModel.unseen_order_bytes), and, in batch size, between an answer
# after an OOM and a size refused (_after_oom).
RUN_SPREAD = 1 / 14
# How far the steps fit() runs at one size can peak above a step recorded once, as the
# first step of its fit(), as a share of that step's own growth from a batch of 1 (see
# unseen_order_bytes): find_batch_size records each size so, one step of a short fit().
# The first step of a fit() peaks lower than the steps after it in some models, and one
# draw shows none of the others: keras.io's "Text classification with Transformer" at
# 324, 461 MiB in its first step and 515 in 30 of the 36 after it (10.6%); find named
# 324, which ran out in every process. Measured on 20 models (benchmarks/NOTES.md, "The
# first step of a fit() is not its steps"): up to 12.6% (a temporal convolution
# network), the zoo's ResNet 3.8%, most under 2%. The largest share measured, rounded up
# to a unit fraction, as RUN_SPREAD is.
ONE_DRAW_SPREAD = 1 / 7
_BATCH = _core.ALLOC_BATCH
_ROWS = _core.ALLOC_BATCH_ROWS
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


def _match(template, other, fixed_kinds=(), fixed_sizes=()):
    """Per allocation of `template`, its line in the batch size, as two bounds:
    (fixed_lo, slope_lo, fixed_hi, slope_hi). A block with one line has both bounds alike.

    With `other` (a step at another batch size), per kind of block:
    - a block tagged batch-shaped whose size scaled to the other batch size is there too is
      proportional (a tensor with the batch as first dimension); so is one whose first
      dimension is a multiple of the batch (TFMG_ALLOC_BATCH_ROWS: a batch-shaped tensor
      with its leading dimensions flattened, as a Dense layer on (batch, steps, features)
      computes on). The zoo's attention model made 2 and 4 MiB blocks of (128 x 64, 64)
      and (128 x 64, 128) floats at 128 samples; paired by exact size with the other
      step's at 64 (whose (64 x 64, 128) block is 2 MiB), they were taken as fixed, and
      the model of 128 said 312 samples need 200-211 MiB, where a step at 300 peaked at
      209 and 312 ran out under 220. The tagged blocks are matched first, the exact sizes
      of the rest after them;
    - an untagged block whose exact size is there too is fixed (a block tagged as rows of
      the batch with no scaled partner is untagged, unless its size is a weight's: a
      weight's gradient with such a first dimension is fixed as a copy of it);
    - the rest of both steps (untagged blocks that changed, and tagged ones that did not
      scale: workspaces that TensorFlow caps, such as convolution backprop's, are tagged at a
      small batch and stop growing at a large one) are paired by rank, and each pair's line
      goes through both sizes (the sum of the pairs' sizes is right at both batch sizes,
      whatever the pairing; the largest with the largest).
    A pair whose line passes below the origin is not one tensor at two sizes (a tensor of
    a + b x B bytes, a >= 0, never grows faster than the batch): one step made a block the
    other did not, and the pair is dropped. TensorFlow's threads decide whether a kernel
    reuses its input's buffer or allocates one: the zoo's wide MLP under 50 MiB made five
    untagged 2 MiB blocks (the first layer's weight size) in a step at 16 and four at 8;
    the fifth, paired with a small block, became proportional (128 KiB a sample), and the
    model of the step at 16 named 24-39 where 348 trains, in 4 of 13 processes.
    What stays unmatched: a tagged block is proportional; an untagged one lies between fixed
    (lo: its size) and proportional (hi: through the origin), unless its kind is one of
    `fixed_kinds` or its size one of `fixed_sizes` (then fixed: the sizes of blocks live at
    the step's start that do not scale, the weights and optimizer slots, of which gradients
    and updates are copies; per size at most the weights' share, _weight_copies)."""
    idx = template.allocations()
    size = template.size[idx].astype(np.float64)
    flags = template.flags[idx]
    bt = float(template.batch_size)
    align = float(max(int(template.layout.get("alignment", 64)), 1))
    tagged = (flags & _BATCH) != 0
    weight_set = {float(v) for v in np.asarray(fixed_sizes, dtype=np.float64).tolist()}
    rows = ((flags & _ROWS) != 0) & ~tagged & ~np.isin(size, list(weight_set))
    kinds = kind_of(flags)
    fixed_lo = np.where(tagged, 0.0, size)
    slope_lo = np.where(tagged, size / bt, 0.0)
    fixed_hi = np.zeros_like(size)
    slope_hi = size / bt
    done = np.zeros(len(size), dtype=bool)

    def line(i, fixed, slope):
        fixed_lo[i], slope_lo[i], fixed_hi[i], slope_hi[i] = fixed, slope, fixed, slope
        done[i] = True

    # An untagged block of a weight's size still live at the step's end (see below).
    state = _live_at_end(template) & np.isin(size, list(weight_set)) if weight_set else np.zeros(len(size), bool)
    pairs = _ordered_pairs(template, other) if other is not None and template.ordered and other.ordered \
        and other.batch_size != template.batch_size else None
    if pairs is not None:
        # Steps that allocate in the same order at both sizes: the k-th allocation of one is
        # the k-th of the other (aligned where the two differ, e.g. a workspace one of them
        # asks for). Matching by size would not do without tags: in a CNN one layer's output
        # at 2b samples is as large as the next layer's (twice the channels, half the area)
        # at b, and would pass for a fixed block.
        bo = float(other.batch_size)
        o_size = other.size[other.allocations()].astype(np.float64)
        for i, j in pairs:
            slope = max((size[i] - o_size[j]) / (bt - bo), 0.0)
            fixed = size[i] - slope * bt
            if fixed >= 0:  # else not one tensor at two sizes (see the docstring)
                line(i, fixed, slope)
    elif other is not None and other.batch_size != template.batch_size:
        bo = float(other.batch_size)
        oi = other.allocations()
        o_size = other.size[oi].astype(np.float64)
        o_kind = kind_of(other.flags[oi])
        # (As for the template's: rows of the batch unless of a weight's size, a weight's
        # gradient whose first dimension the batch divides; the wide MLP's 8,192 x 64 at
        # 16 found no partner at 8, was paired by rank and became proportional: 47 named.)
        o_flags = other.flags[oi]
        o_shaped = ((o_flags & _BATCH) != 0) | (((o_flags & _ROWS) != 0) & ~np.isin(o_size, list(weight_set)))
        for k in np.unique(kinds):
            # The other step's blocks by size, those the plugin tagged as shaped by the batch
            # apart: a tagged block's partner is tagged too, an untagged one's untagged (a
            # tensor's first dimension is the batch at every size or at none). Taken
            # together, the zoo's autoencoder's batches of 181 samples (12 KiB a sample)
            # scaled to 1,152 took the partners of its convolution workspaces of 13.5 MiB,
            # the size of a batch of 1,152 (1,152 x 12 KiB); a workspace left without its
            # partner was taken as proportional (85.9 MiB at 1,152).
            counts = ({}, {})
            for v, t in zip(o_size[o_kind == k].tolist(), o_shaped[o_kind == k].tolist()):
                counts[t][v] = counts[t].get(v, 0) + 1

            def take(v, shaped):
                if counts[shaped].get(v, 0) > 0:
                    counts[shaped][v] -= 1
                    return True
                return False

            mine = np.flatnonzero(kinds == k)
            rest = []
            for i in mine:
                if tagged[i] or rows[i]:
                    scaled = np.ceil(size[i] * bo / bt / align) * align
                    if take(scaled, True) or take(scaled - align, True) or take(scaled + align, True):
                        line(i, 0.0, size[i] / bt)
                        continue
            for i in mine:
                if done[i]:
                    continue
                if not tagged[i] and state[i]:
                    # State the step made (below) is fixed before the partners are taken:
                    # the wide MLP's first step at 128 made six 4 MiB blocks (its kernel's
                    # size: Adam's two slots among them), the step at 64 four; the slots took
                    # two of the four partners, and a gradient left over, paired by rank,
                    # became proportional (the first step's model named 158; 348 trains).
                    line(i, size[i], 0.0)
                    continue
                if not tagged[i] and take(size[i], False):
                    line(i, size[i], 0.0)
                    continue
                rest.append(i)
            left = sorted(v for c in counts for v, n in c.items() for _ in range(n))
            rest.sort(key=lambda i: size[i])
            m = min(len(rest), len(left))
            for i, v in zip(rest[len(rest) - m:], left[len(left) - m:]):
                slope = max((size[i] - v) / (bt - bo), 0.0)
                fixed = size[i] - slope * bt
                if fixed >= 0:  # else not one tensor at two sizes: left unmatched, below
                    line(i, fixed, slope)
    rest = np.flatnonzero(~done & ~tagged)
    for i in rest:
        if kinds[i] in fixed_kinds:
            line(i, size[i], 0.0)
    # State the step made: an untagged block of a weight's size still live at the step's
    # end (a step frees its activations and gradients before it ends) is an optimizer
    # slot or a weight's new buffer. The wide MLP's first step under 50 MiB builds Adam's
    # two 2 MiB slots of its first layer; a third 2 MiB block of that step had no match
    # either, the weights' share (below) allowed two, and the slot left over, taken as
    # proportional (128 KiB a sample), made the first step's model name 78 where 348 trains.
    for i in rest[~done[rest]]:
        if state[i]:
            line(i, size[i], 0.0)
    for i in _weight_copies(size, rest[~done[rest]], fixed_sizes):
        line(i, size[i], 0.0)
    return fixed_lo, slope_lo, fixed_hi, slope_hi


def _live_at_end(trace):
    """Per allocation of `trace` (in allocations() order): True when no later event of the
    step frees its block (refused requests hold none)."""
    live = {}
    for k, (op, addr) in enumerate(zip(trace.op.tolist(), trace.address.tolist())):
        if op == _FREE:
            live.pop(addr, None)
        elif op != _REFUSE and addr:
            live[addr] = k
    out = np.zeros(len(trace.op), dtype=bool)
    out[list(live.values())] = True
    return out[trace.allocations()]


def _weight_copies(size, candidates, weight_sizes):
    """Of the allocations `candidates` (indices into `size`, in the step's order), those
    taken as copies of the weights (gradients, updates): of a size among `weight_sizes`
    (the blocks live at the step's start that do not scale, with repeats), and per size at
    most as many as the weights' own share allows. The optimizer makes the same copies of
    every variable, so a size's allocations per start block are alike across the weights'
    sizes; a size with more is also an activation's. On the H200, after an out-of-memory
    error, a 16 MiB block live at a step's start (not a weight) had the size of 13 of the
    step's activations at 32 (the weights' sizes: 2 per start block); taken as fixed, they
    made the model of the step name 408 where 197 is the most that trains. The median of
    the sizes' shares is that share (one coincidence cannot move it); the copies are the
    last ones of their size (gradients and updates follow the forward pass)."""
    if len(candidates) == 0 or len(weight_sizes) == 0:
        return []
    at_start = {}
    for v in np.asarray(weight_sizes, dtype=np.float64).tolist():
        at_start[v] = at_start.get(v, 0) + 1
    by_size = {}
    for i in candidates.tolist():
        if size[i] in at_start:
            by_size.setdefault(float(size[i]), []).append(i)
    if not by_size:
        return []
    share = float(np.median([len(v) / at_start[s] for s, v in by_size.items()]))
    out = []
    for s, found in by_size.items():
        allowed = int(np.ceil(share * at_start[s]))
        out.extend(found[len(found) - allowed:] if allowed < len(found) else found)
    return out


def _ordered_pairs(template, other):
    """(template allocation, other allocation) index pairs of two steps recorded in the same
    order, aligned on the sequence of their allocations and frees (difflib), of one kind."""
    import difflib

    def events(t):
        allocs = t.allocations()
        token = np.where(t.op == _FREE, 0, 1 + kind_of(t.flags)).astype(np.int64)
        return [int(v) for v in token], {int(e): k for k, e in enumerate(allocs.tolist())}
    a, a_index = events(template)
    b, b_index = events(other)
    pairs = []
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            i, j = block.a + k, block.b + k
            if i in a_index and j in b_index:
                pairs.append((a_index[i], b_index[j]))
    return pairs


@dataclasses.dataclass
class StepModel:
    """Every block of a step as a line in the batch size, replayed through the pool.

    Made by StepModel.build(); the blocks live at the start and the step's events may come
    from different recorded steps (after an out-of-memory error, the failed step's start in
    fit() and a complete lone step)."""

    start_fixed: np.ndarray
    start_slope: np.ndarray
    start_flags: np.ndarray
    ev_alloc: np.ndarray      # per event: True for an allocation
    ev_slot: np.ndarray
    ev_flags: np.ndarray
    ev_fixed_lo: np.ndarray   # per event (allocations; 0 for frees): the line below the
    ev_lo: np.ndarray         # recorded batch size (fixed bytes, slope)...
    ev_fixed_hi: np.ndarray   # ... and above it
    ev_hi: np.ndarray
    nslots: int
    base_batch: int           # the batch size the events were recorded at
    layout: dict
    spread_bytes: int = 0     # kept free: how much higher fit()'s steps peaked
    # How far above the highest step at base_batch an order of the kernels not met could
    # peak (StepSampler.order_bytes; scaled in spread()); 0: none measured.
    order_bytes: int = 0
    # The batch size order_bytes was measured at (the run's own steps'), which the lone
    # short fit()'s model, recorded at another size, does not share; 0: base_batch.
    order_batch: int = 0
    complete: bool = True
    # The step runs on a pool no long run has been through (a run's first step, which traces
    # the function and builds the optimizer's slots): LAYOUT_SLACK, kept for the layout a
    # long run leaves, is not kept (layout_margin).
    fresh: bool = False
    # The epoch's samples and the bytes per sample of one of its batches (Keras' pipeline
    # over arrays), when the prepared batches at a step's start are bounded by the epoch
    # (see _ops); 0: not bounded (a dataset, steps_per_epoch given, another framework).
    samples: int = 0
    batch_bytes_per_sample: float = 0.0
    prepared_per_sample: float = 0.0  # unused since _epoch.bounded; kept so older saved reports load
    # The bytes per sample of each of the epoch's arrays (x's and y's leaves): a batch of k
    # samples of one is a block of k times that (_epoch.array_batches); (): unknown.
    array_bytes: tuple = ()
    # How many of the start blocks were added to the recorded ones (build's extra_start:
    # batches other steps met, room for what a model fell short of); they are the last.
    added_start: int = 0
    # The template allocates in one order every step (StepTrace.ordered: PyTorch's eager
    # steps): no order of the kernels is left unmet (unseen_order_bytes).
    ordered: bool = False
    # The share of the step's own growth kept free for orders not met (unseen_order_bytes):
    # RUN_SPREAD for a run's steps, ONE_DRAW_SPREAD for steps recorded once each
    # (find_batch_size).
    unseen_share: float = RUN_SPREAD

    @classmethod
    def build(cls, template, other=None, start=None, observed_peak=None, first=False, extra_start=None,
              epoch=None, order_bytes=0, fresh=None, layout_bytes=0, order_batch=0, unseen_share=RUN_SPREAD):
        """The model of `template`'s step (complete), its untagged blocks' slopes from
        `other`, starting from `start`'s live blocks (default: template's own) and
        `extra_start` ((sizes, flags) of more blocks live then, recorded at start's batch
        size), and the spread from `observed_peak` (default: template.observed_peak).
        `first`: the template is a run's first step, which traces the step's function: its
        blocks made outside kernels that no second step explains (graph optimization's
        constants and copies, tf.data's set-up) are taken as fixed, where a steady step's
        would be bounded (the batch-shaped ones among them are made by kernels, tagged).
        `epoch`: (samples, bytes per sample of a batch) of the epochs fit() runs over arrays,
        or None (see _ops). `order_bytes`: how far above the template an order of the
        kernels not met could peak at `order_batch` (default: the recorded size; see
        spread()). `fresh`: the step
        runs on a pool no long run has been through, so LAYOUT_SLACK is not kept (default:
        `first`; after an out-of-memory error the retry's first step meets the failed
        run's layout, and the slack is kept). `layout_bytes`: how many more bytes of
        backing granules than the run's template another of its steps touched
        (StepSampler.layout_bytes), kept free (as spread, where more). `unseen_share`:
        the share of the step's growth kept free for orders not met (unseen_order_bytes).
        """
        start = start or template
        fixed_kinds = [KINDS.index(k) for k in ("constant", "copy", "tensor", "raw", "data", "input")] if first else ()
        weights = start.start_size[(start.start_flags & _BATCH) == 0]
        # Blocks of 64 KiB and more: small sizes recur everywhere (scalars, shapes).
        fixed_lo, lo, fixed_hi, hi = _match(template, other, fixed_kinds, weights[weights >= 1 << 16])
        bs = float(start.batch_size)
        start_flags = start.start_flags
        s_size = start.start_size.astype(np.float64)
        if extra_start is not None and len(extra_start[0]):
            s_size = np.concatenate([s_size, np.asarray(extra_start[0], dtype=np.float64)])
            start_flags = np.concatenate([start_flags, np.asarray(extra_start[1], dtype=np.uint32)])
        s_tag = (start_flags & _BATCH) != 0
        start_fixed = np.where(s_tag, 0.0, s_size)
        start_slope = np.where(s_tag, s_size / bs, 0.0)
        # Events as replay ops: start blocks take slots 0..n-1, each allocation a new slot,
        # a free the slot its address holds (frees of blocks from before the start or
        # outside the trace are dropped).
        n_start = len(s_size)
        where = {int(a): i for i, a in enumerate(start.start_address.tolist())} if start is template else {}
        alloc_idx = template.allocations()
        per_alloc = {int(i): j for j, i in enumerate(alloc_idx.tolist())}
        nslots = n_start
        ev_alloc, ev_slot, ev_flags, ev_flo, ev_lo, ev_fhi, ev_hi = [], [], [], [], [], [], []
        for i, (op, addr, flags) in enumerate(zip(template.op.tolist(), template.address.tolist(),
                                                  template.flags.tolist())):
            if op == _FREE:
                slot = where.pop(addr, None)
                if slot is None:
                    continue
                ev_alloc.append(False), ev_slot.append(slot), ev_flags.append(0)
                ev_flo.append(0.0), ev_lo.append(0.0), ev_fhi.append(0.0), ev_hi.append(0.0)
                continue
            j = per_alloc[i]
            slot = nslots
            nslots += 1
            if op != _REFUSE and addr:
                where[addr] = slot
            # A refused request was one that could be refused; overshoot could not.
            f = (flags | _MUST) if op == _OVERSHOOT else (flags & ~_MUST if op == _REFUSE else flags)
            ev_alloc.append(True), ev_slot.append(slot), ev_flags.append(f)
            ev_flo.append(fixed_lo[j]), ev_lo.append(lo[j]), ev_fhi.append(fixed_hi[j]), ev_hi.append(hi[j])
        model = cls(start_fixed=start_fixed, start_slope=start_slope, start_flags=start_flags.copy(),
                    ev_alloc=np.array(ev_alloc, dtype=bool), ev_slot=np.array(ev_slot, dtype=np.uint32),
                    ev_flags=np.array(ev_flags, dtype=np.uint32), ev_fixed_lo=np.array(ev_flo),
                    ev_lo=np.array(ev_lo), ev_fixed_hi=np.array(ev_fhi), ev_hi=np.array(ev_hi), nslots=nslots,
                    base_batch=int(template.batch_size), layout=dict(template.layout),
                    complete=bool(template.complete), order_bytes=int(max(0, order_bytes)),
                    order_batch=int(order_batch or 0), unseen_share=float(unseen_share),
                    fresh=bool(first if fresh is None else fresh),
                    samples=int(epoch[0]) if epoch else 0,
                    batch_bytes_per_sample=float(epoch[1]) if epoch else 0.0,
                    array_bytes=tuple(float(v) for v in epoch[2]) if epoch and len(epoch) > 2 else (),
                    added_start=len(s_size) - len(start.start_size), ordered=bool(template.ordered))
        peak = template.observed_peak if observed_peak is None else observed_peak
        if peak:
            replayed = model.need(template.batch_size)["peak_account"]
            model.spread_bytes = int(max(0, peak - replayed))
        # The replay places the template's blocks as the pool placed them (the granules
        # it touches are the recorded step's to 0.3% on the zoo's models), but another
        # step of the run can leave small blocks in more granules partly used at a lower
        # peak: the zoo's BiLSTM (48 MiB budget) touched up to 0.94 MiB more than its
        # template in a run at 139, 0.50 at 270 (not more at the larger size: kept whole).
        model.spread_bytes = int(max(model.spread_bytes, layout_bytes))
        return model

    # -- sizes and replays ---------------------------------------------------------------

    def _ops(self, batch_size):
        """The replay's ops at `batch_size`: the blocks live at the start, then the step.
        Returns (sizes, slots, flags, nslots)."""
        b = float(batch_size)
        # Above the recorded size the bound that needs more is the proportional one, below
        # it the fixed one.
        fixed, slope = (self.ev_fixed_hi, self.ev_hi) if b >= self.base_batch else (self.ev_fixed_lo, self.ev_lo)
        align = max(int(self.layout.get("alignment", 64)), 1)
        ev = np.where(self.ev_alloc, np.maximum(fixed + slope * b, 1.0), 0.0)
        st = self.start_fixed + self.start_slope * b
        if self.samples and self.batch_bytes_per_sample > 0:
            st, ev = _epoch.bounded(self, b, st, ev)
        st = np.maximum(st, 1.0)
        ev = np.where(self.ev_alloc, np.maximum(ev, 1.0), 0.0)
        sizes = (np.ceil(np.concatenate([st, ev]) / align) * align).astype(np.uint64)
        # Start blocks keep their flags (MUST_SUCCEED for overshoot): they exist whatever
        # the budget; they are allocated first, as what the step finds live.
        slots = np.concatenate([np.arange(len(st), dtype=np.uint32), self.ev_slot])
        flags = np.concatenate([self.start_flags | _MUST,
                                np.where(self.ev_alloc, self.ev_flags, _core.STEP_FREE).astype(np.uint32)])
        return sizes, slots, flags.astype(np.uint32), self.nslots

    def spread(self, batch_size):
        """Bytes kept free at `batch_size` for the peaks of orders the template did not
        show: what other steps of the run peaked above the template's replay
        (`spread_bytes`), and above that how far an order of the kernels not met could
        peak above the highest met (`order_bytes`, StepSampler.order_bytes), scaled to
        `batch_size` above the recorded size.

        The template is the highest step recorded, but a run at another size, in another
        process, draws the order in which TensorFlow's threads run the kernels anew: the
        zoo's ResNet at 300 peaked at 404.5 MiB in two processes and at 380.5 in a third,
        and three runs at 150 whose highest steps peaked at 223.4, 228.6 and 223.3 named
        296, 294 and 305 (301 trains). The blocks an order moves are the step's, each at
        most proportional to the batch: above the recorded size the gap scales with it,
        below it is kept whole (a fixed block's order moves it as much). The gap scales
        from the size it was measured at (`order_batch`): the zoo's autoencoder's gap of
        16 MiB at 512, scaled from the 256 of the short fit()'s model, kept 56 MiB free at
        900 where 28 is the gap's share."""
        scale = max(1.0, float(batch_size) / max(self.order_batch or self.base_batch, 1))
        return int(self.spread_bytes + max(self.order_bytes * scale, self.unseen_order_bytes(batch_size)))

    def unseen_order_bytes(self, batch_size):
        """The least kept free at `batch_size` for orders of the kernels that no recorded
        step met: `unseen_share` (RUN_SPREAD, or ONE_DRAW_SPREAD) of what the step's own
        bytes (its peak less the blocks live at its start, which no order moves) grew by
        from a batch of 1. The orders a run meets
        depend on its kernels' timing, which grows with the batch: keras.io's text CNN's 64
        steps at 132 all peaked alike, while at 277 every few steps one allocated its 68
        MiB dropout mask at a worse moment, 11.6 MiB above the others (about 6% of that
        step's 188 MiB), and the model of the steps at 132 named 277 (264 trains). The
        part that does not grow is left out: its orders are met at the running size as at
        any other, and a run's first step, which builds the optimizer's slots, holds much
        of it (the zoo's embedding model's first step peaks at 74.5 of its 76 MiB whatever
        the batch size; with 6% of all of it kept, no size above the running one fitted).
        Nothing for a step whose kernels allocate in one order every time (`ordered`)."""
        if self.ordered:
            return 0
        # (At a batch of 1 it is the same for every replay: worked out once per model.)
        if "_own_at_one" not in self.__dict__:
            self._own_at_one = self._own_bytes(1)
        return int(self.unseen_share * max(0, self._own_bytes(batch_size) - self._own_at_one))

    def _own_bytes(self, batch_size):
        sizes, _, _, _ = self._ops(batch_size)
        return int(self.need(batch_size)["peak_account"]) - int(sizes[:len(self.start_fixed)].sum())

    def optimistic(self):
        """The same model with the other bound for blocks known only to lie between fixed
        and proportional: how much the answer depends on them."""
        return dataclasses.replace(self, ev_fixed_lo=self.ev_fixed_hi, ev_lo=self.ev_hi,
                                   ev_fixed_hi=self.ev_fixed_lo, ev_hi=self.ev_lo)

    def layout_margin(self, batch_size, budget):
        """Bytes kept free at `batch_size` for the layout another order and a long run's
        history leave: a granule for each large block live at the step's peak, and at
        least LAYOUT_SLACK of the budget (see the module's docstring), except in a run's
        first step, which no long run precedes. The zoo's embedding model under 76 MiB:
        the first step, building Adam's slots of its 12 MiB table, peaks at 74.5-74.8
        MiB whatever the batch size (823 trains); with 2% kept free, no size fitted."""
        slack = 0.0 if self.fresh else LAYOUT_SLACK
        if not self.layout.get("backs_on_demand", True):
            return int(slack * budget)
        return max(int(self.need(batch_size)["large_blocks_at_peak"]) * _granule(self.layout), int(slack * budget))

    def replay(self, batch_size, budget):
        """The step at `batch_size` under `budget` bytes (spread and layout margin kept
        free): a dict with fits, failed_at, peak_bytes_reserved, peak_account,
        peak_overshoot, blocks_at_peak, large_blocks_at_peak, slack_at_peak."""
        sizes, slots, flags, nslots = self._ops(batch_size)
        room = int(budget) - self.spread(batch_size) - self.layout_margin(batch_size, budget)
        if room <= 0:
            return {"fits": False, "failed_at": 0, "peak_bytes_reserved": 0, "peak_account": 0, "peak_overshoot": 0,
                    "blocks_at_peak": 0, "large_blocks_at_peak": 0, "slack_at_peak": 0}
        lay = self.layout
        r = _core.replay_step(sizes, slots, flags, nslots, room, upstream=_replay_upstream(lay),
                              alignment=int(lay.get("alignment", 0)), granule_bytes=_granule(lay),
                              address_factor=int(lay.get("address_factor", 0)),
                              small_threshold=int(lay.get("small_threshold", 0)))
        # Start blocks over the budget are granted as overshoot, never refused: they are
        # what the step meets. A step whose start alone passes the budget does not fit, nor
        # one whose own requests that cannot be refused (XLA's buffers, oneDNN's kernels,
        # numpy values made into tensors) pass it: the pool would grant them over the
        # budget, and MemGuardCallback stops a run at XLA's or oneDNN's. (keras.applications'
        # ConvNeXtTiny, whose AdamW step TensorFlow runs partly through XLA on the CPU, at
        # 171 under 1,100 MiB: its first step was granted 662 MiB over the budget, and the
        # run was stopped with "a batch size of up to 200 fits".)
        if r["fits"] and r["peak_overshoot"] > 0 and (self._start_overshoot(sizes, room)
                                                      or self._own_overshoot(sizes, slots, flags, nslots, room,
                                                                             r["peak_overshoot"])):
            r["fits"] = False
        return r

    def _start_overshoot(self, sizes, room):
        return int(sizes[:len(self.start_fixed)].sum()) > room

    def _own_overshoot(self, sizes, slots, flags, nslots, room, peak_overshoot):
        """Whether the step's own requests took the overshoot above what its start blocks,
        laid out in `room`, were granted over it: a replay of the start blocks alone."""
        k = len(self.start_fixed)
        lay = self.layout
        start = _core.replay_step(sizes[:k], slots[:k], flags[:k], nslots, room, upstream=_replay_upstream(lay),
                                  alignment=int(lay.get("alignment", 0)), granule_bytes=_granule(lay),
                                  address_factor=int(lay.get("address_factor", 0)),
                                  small_threshold=int(lay.get("small_threshold", 0)))
        return int(peak_overshoot) > int(start["peak_overshoot"])

    def need(self, batch_size):
        """The replay at `batch_size` with a budget that always fits: its peaks."""
        sizes, slots, flags, nslots = self._ops(batch_size)
        big = int(sizes.sum()) * 2 + (1 << 30)
        lay = self.layout
        return _core.replay_step(sizes, slots, flags, nslots, big, upstream=_replay_upstream(lay),
                                 alignment=int(lay.get("alignment", 0)), granule_bytes=_granule(lay),
                                 address_factor=int(lay.get("address_factor", 0)),
                                 small_threshold=int(lay.get("small_threshold", 0)))

    def fits(self, batch_size, budget):
        return self.replay(batch_size, budget)["fits"]

    def largest_fitting(self, budget, at_most=None):
        """The largest batch size whose step fits `budget`, or 0 when not even 1 does.
        Bisection: the model's need grows with the batch size."""
        if (at_most is not None and at_most < 1) or not self.fits(1, budget):
            return 0
        hi = self.base_batch
        while self.fits(hi, budget):
            if at_most is not None and hi >= at_most:
                return int(at_most)
            hi *= 2
            if hi > 1 << 30:
                return hi
        lo = 1 if hi <= self.base_batch else hi // 2
        if at_most is not None:
            hi = min(hi, at_most + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, budget) else (lo, mid)
        return lo

    def budget_for(self, batch_size):
        """The smallest budget (bytes) under which `batch_size` fits: a bisection of
        replays between the need's peaks."""
        need = self.need(batch_size)
        lo, hi = need["peak_account"] // 2, need["peak_bytes_reserved"] + self.spread(batch_size) + (1 << 20)
        while not self.fits(batch_size, hi):
            hi *= 2
        while hi - lo > 1 << 16:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self.fits(batch_size, mid) else (mid, hi)
        return int(hi)

    # -- saved models (the report's JSON, what-if) -----------------------------------------

    def to_dict(self):
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d):
        d = dict(d)
        if "array_bytes" in d:
            d["array_bytes"] = tuple(d["array_bytes"])
        types = {"start_fixed": np.float64, "start_slope": np.float64, "start_flags": np.uint32,
                 "ev_alloc": bool, "ev_slot": np.uint32, "ev_flags": np.uint32, "ev_fixed_lo": np.float64,
                 "ev_lo": np.float64, "ev_fixed_hi": np.float64, "ev_hi": np.float64}
        return cls(**{k: (np.asarray(v, dtype=types[k]) if k in types else v) for k, v in d.items()})


def _replay_upstream(layout):
    # The replay never touches memory: pools backed on demand are replayed as host_lazy
    # (bookkeeping) with the device's granule; a plain pool as one region of host memory
    # (address space only, mmap NORESERVE).
    return "host_lazy" if layout.get("backs_on_demand", True) else "host"


def _granule(layout):
    return int(layout.get("page_bytes", 0)) if layout.get("backs_on_demand", True) else 0


def alike_groups(alike, same):
    """The peaks of alike steps, grouped: `alike` maps (bytes in use at a step's start,
    batch-tagged bytes at its end) to peaks; steps whose start differs by at most `same`
    bytes (a granule of the pool's backing) with the same batch bytes are one group, as
    peaks within a granule count as one order. The zoo's mixed-precision CNN at 256: its
    steps began with 36,192,896 or 36,196,864 bytes (a 4 KiB block apart) and peaked at
    100.4 or 113.2 MiB in both; kept apart, 113.2 was met once in one of them, 12.9 MiB
    above the next, and the order gap that made (31.6 MiB at 629) named 629 where 781 and
    799 were named in the other runs (817 trains)."""
    groups = []
    for (began, batch), peaks in sorted(alike.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if groups and groups[-1][0] == batch and began - groups[-1][1] <= same:
            groups[-1][1] = began
            groups[-1][2].extend(peaks)
        else:
            groups.append([batch, began, list(peaks)])
    return [g[2] for g in groups]


def order_gap(peaks, same, least=3):
    """The order gap of alike steps' `peaks` (StepSampler.order_bytes): at least `least`
    of them, and the highest met once (peaks within `same` bytes count as one), how far it
    lies above the next one down; else 0."""
    p = sorted(int(v) for v in peaks)
    if len(p) < least:
        return 0
    below = [v for v in p if v < p[-1] - same]
    return p[-1] - below[-1] if below and len(p) - len(below) == 1 else 0


class StepModels:
    """The StepModels a run at batch size B must survive, by which trace of the step B runs.

    Keras feeds arrays through a tf.data pipeline whose batches have a known size only when
    the batch size divides the number of samples; otherwise the last batch is partial and
    TensorFlow traces the step with an unknown batch dimension, a graph that needs more
    (the zoo's GRU under 72 MiB: 512 samples train, 505 and 518 run out in the first step).
    So each model has a domain: "all", "static" (batch sizes that divide `samples`) or
    "dynamic" (the others; also what a static batch size falls back on when no model of
    its own domain exists). A batch size fits when every model of its domain fits; its need
    is the largest of theirs. A size that does not divide the samples must also fit the
    models of the known-size trace: the trace with an unknown batch dimension needs at
    least as much (the same graph, fewer shapes known), and its model is one short fit()'s
    step, a single draw taken inside the run. On the zoo's autoencoder (2,048 samples,
    240 MiB) the model of such a step at 256 named 1,262, which ran out, where the
    known-size steps at 512 named 931 (1,139 is the most that trains). The run's first step (it traces the function: graph
    optimization allocates then, and tf.data has not prepared its batches yet) is one model,
    the steady steps another."""

    def __init__(self, models, domains=None, samples=None):
        pairs = [(m, d) for m, d in zip(models, domains or ["all"] * len(models)) if m is not None]
        if not pairs:
            raise ValueError("StepModels needs at least one StepModel")
        self.models = [m for m, _ in pairs]
        self.domains = [d for _, d in pairs]
        self.samples = samples

    def _static(self, batch_size):
        return bool(self.samples) and self.samples % int(batch_size) == 0

    def _for(self, batch_size):
        if not self._static(batch_size) or not any(d == "static" for d in self.domains):
            return self.models
        return [m for m, d in zip(self.models, self.domains) if d in ("all", "static")]

    @property
    def base_batch(self):
        return self.models[0].base_batch

    @property
    def spread_bytes(self):
        return max(m.spread_bytes for m in self.models)

    def spread(self, batch_size):
        return max(m.spread(batch_size) for m in self._for(batch_size))

    def fits(self, batch_size, budget):
        return all(m.fits(batch_size, budget) for m in self._for(batch_size))

    def need(self, batch_size):
        return max((m.need(batch_size) for m in self._for(batch_size)), key=lambda r: r["peak_account"])

    def largest_fitting(self, budget, at_most=None):
        """The largest batch size that fits: the largest of the sizes whose trace has an
        unknown batch dimension (bisection: their need grows with the batch), and, where a
        model of the known-size trace exists, of the sizes that divide the samples."""
        best = min(m.largest_fitting(budget, at_most=at_most) for m in self.models)
        while best > 0 and self._static(best) and not self.fits(best, budget):
            best -= 1  # a size that divides the samples runs the other trace
        if self.samples and any(d == "static" for d in self.domains):
            top = min(self.samples, at_most or self.samples)
            for d in sorted((d for d in _divisors(self.samples) if best < d <= top), reverse=True):
                if self.fits(d, budget):
                    return d
        return best

    def budget_for(self, batch_size):
        return max(m.budget_for(batch_size) for m in self._for(batch_size))

    def optimistic(self):
        return StepModels([m.optimistic() for m in self.models], self.domains, self.samples)

    def to_dict(self):
        return {"models": [m.to_dict() for m in self.models], "domains": self.domains, "samples": self.samples}

    @classmethod
    def from_dict(cls, d):
        return cls([StepModel.from_dict(m) for m in d["models"]], d.get("domains"), d.get("samples"))


def _divisors(n):
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
