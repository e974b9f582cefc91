"""A model of one training step's memory: does batch size B fit budget M?

Every block of a recorded step (_step_trace.StepTrace) is a line in the batch size
(_model_build: tagged blocks proportional, the rest matched against a second step at
another size, or bounded between fixed and proportional).

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
from tf_memguard._step_trace import _MUST

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
    # Per event, bytes per squared sample: the blocks that grow with the square of the batch
    # (batch x batch tensors, _model_build.match), whose lines are 0; None: none (and
    # saved reports from before it).
    ev_square: object = None

    @classmethod
    def build(cls, template, other=None, **kwargs):
        """The model of `template`'s step, its untagged blocks' slopes from `other` (a
        step at another batch size): _model_build.build, whose docstring names the
        other arguments."""
        from tf_memguard import _model_build  # (it imports this module)
        return _model_build.build(template, other, **kwargs)

    # -- sizes and replays ---------------------------------------------------------------

    def _ops(self, batch_size):
        """The replay's ops at `batch_size`: the blocks live at the start, then the step.
        Returns (sizes, slots, flags, nslots)."""
        b = float(batch_size)
        # Above the recorded size the bound that needs more is the proportional one, below
        # it the fixed one.
        fixed, slope = (self.ev_fixed_hi, self.ev_hi) if b >= self.base_batch else (self.ev_fixed_lo, self.ev_lo)
        align = max(int(self.layout.get("alignment", 64)), 1)
        ev = fixed + slope * b
        if self.ev_square is not None:
            ev = ev + self.ev_square * (b * b)
        ev = np.where(self.ev_alloc, np.maximum(ev, 1.0), 0.0)
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
        at = max(self.order_batch or self.base_batch, 1)
        scale = max(1.0, float(batch_size) / at)
        # Of the gap, no more can grow with the batch than the step's proportional bytes
        # live at once (the blocks an order moves are live together at its peak); the rest
        # is fixed blocks, moved as much at any size (moving_bytes).
        moved = min(self.order_bytes, self.moving_bytes(at))
        order = self.order_bytes + moved * (scale - 1.0)
        return int(self.spread_bytes + max(order, self.unseen_order_bytes(batch_size)))

    def moving_bytes(self, batch_size):
        """The most of the step's own bytes that grow with the batch live at once at
        `batch_size` (each allocation's proportional part, the bound above the recorded
        size): what an order of the kernels can move that scales with the batch. A gap
        between orders larger than this is fixed blocks for the rest: a CNN recorded at a
        batch of 1 (activations of about 0.3 MiB a sample) met one step whose peak stood 12
        MiB above the others', and scaled whole with the batch that gap named 4 where 121
        trains (CI, 2026-12-07)."""
        cache = self.__dict__.setdefault("_moving", {})
        if batch_size not in cache:
            b = float(batch_size)
            part = np.where(self.ev_alloc, self.ev_hi * b + (self.ev_square * b * b if self.ev_square is not None
                                                             else 0.0), 0.0)
            per_slot = np.zeros(self.nslots)
            per_slot[self.ev_slot[self.ev_alloc]] = part[self.ev_alloc]
            delta = np.where(self.ev_alloc, part, -per_slot[self.ev_slot])
            cache[batch_size] = float(max(0.0, np.cumsum(delta).max())) if len(delta) else 0.0
        return cache[batch_size]

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
        Nothing for a step whose kernels allocate in one order every time (`ordered`).
        The bytes at a batch of 1 are the lines' that hold above the recorded size: a
        block known only to lie between fixed and proportional (no partner at the other
        size) counts as growth, as it is modelled at larger sizes; taken as fixed at 1, as
        the bound below the recorded size has it, it was no growth at all, and nothing was
        kept for its orders (a sparse bag-of-words model's blocks of nonzeros x 256 floats,
        whose sizes move with each batch's nonzeros, were left unpaired in some of
        find_batch_size's steps). No block of the zoo's models is so: the answers of
        their models of two steps (at 64 and 32, 160 and 80) are unchanged."""
        if self.ordered:
            return 0
        # (At a batch of 1 it is the same for every replay: worked out once per model.)
        if "_own_at_one" not in self.__dict__:
            above = dataclasses.replace(self, ev_fixed_lo=self.ev_fixed_hi, ev_lo=self.ev_hi)
            self._own_at_one = above._own_bytes(1)
        return int(self.unseen_share * max(0, self._own_bytes(batch_size) - self._own_at_one))

    def _own_bytes(self, batch_size):
        sizes, _, _, _ = self._ops(batch_size)
        return int(self.need(batch_size)["peak_account"]) - int(sizes[:len(self.start_fixed)].sum())

    def with_shortfall(self, per_sample, flags):
        """The same model with one more block live at the step's start, of `per_sample`
        bytes per sample (flags `flags`, batch-tagged): what a size refused where the model
        said it fits showed the model short by, at least (as find_batch_size keeps it)."""
        if per_sample <= 0:
            return self
        n = len(self.start_fixed)
        # The new start block takes slot n: the step's own blocks move up one slot.
        ev_slot = np.where(self.ev_slot >= n, self.ev_slot + 1, self.ev_slot).astype(np.uint32)
        return dataclasses.replace(self, start_fixed=np.append(self.start_fixed, 0.0),
                                   start_slope=np.append(self.start_slope, float(per_sample)),
                                   start_flags=np.append(self.start_flags, np.uint32(flags)).astype(np.uint32),
                                   ev_slot=ev_slot, nslots=self.nslots + 1, added_start=self.added_start + 1)

    def optimistic(self):
        """The same model with the other bound for blocks known only to lie between fixed
        and proportional: how much the answer depends on them."""
        return dataclasses.replace(self, ev_fixed_lo=self.ev_fixed_hi, ev_lo=self.ev_hi,
                                   ev_fixed_hi=self.ev_fixed_lo, ev_hi=self.ev_lo)

    def layout_margin(self, batch_size, budget, as_run=False):
        """Bytes kept free at `batch_size` for the layout another order and a long run's
        history leave: a granule for each large block live at the step's peak, and at
        least LAYOUT_SLACK of the budget (see the module's docstring), except in a run's
        first step, which no long run precedes. The zoo's embedding model under 76 MiB:
        the first step, building Adam's slots of its 12 MiB table, peaks at 74.5-74.8
        MiB whatever the batch size (823 trains); with 2% kept free, no size fitted.

        `as_run`: the question is whether the recorded step itself fits, at its own size
        (the short runs after an OOM, whose steps completed: does the retry fit with what
        they did not show?). A step that allocates in one order every time (`ordered`:
        PyTorch's eager steps) then ran the only order there is, its large blocks laid out
        as the pool lays them: LAYOUT_SLACK is kept for a long run's history, and no
        granule per large block. (At other sizes the granules stay: they also cover what
        a line through one or two sizes gets wrong. A model of one step at 32 of a CNN on
        an H200 names 202 with LAYOUT_SLACK alone, and 198 with the granules, where 197
        trains: test_memory_model.py.) keras_hub's Swin Transformer under 1.5 GiB on an
        H100 has 58 large blocks live at its peak: 116 MiB (7.5% of the budget) kept free.
        After an OOM at 731 its short run at 411 completed and was not taken; the answer
        was 383, and 411 and 440 then trained in that process (457 is the most that trains
        in a fresh one; benchmarks/NOTES.md, "A short run's own step on a GPU")."""
        slack = 0.0 if self.fresh else LAYOUT_SLACK
        if not self.layout.get("backs_on_demand", True) or as_run and self.ordered \
                and batch_size == self.base_batch:
            return int(slack * budget)
        return max(int(self.need(batch_size)["large_blocks_at_peak"]) * _granule(self.layout), int(slack * budget))

    def replay(self, batch_size, budget, as_run=False):
        """The step at `batch_size` under `budget` bytes (spread and layout margin kept
        free; `as_run`: see layout_margin): a dict with fits, failed_at,
        peak_bytes_reserved, peak_account, peak_overshoot, blocks_at_peak,
        large_blocks_at_peak, slack_at_peak."""
        sizes, slots, flags, nslots = self._ops(batch_size)
        room = int(budget) - self.spread(batch_size) - self.layout_margin(batch_size, budget, as_run)
        if room <= 0:
            return {"fits": False, "failed_at": 0, "peak_bytes_reserved": 0, "peak_account": 0, "peak_overshoot": 0,
                    "blocks_at_peak": 0, "large_blocks_at_peak": 0, "slack_at_peak": 0}
        r = _replay(self.layout, sizes, slots, flags, nslots, room)
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
        start = _replay(self.layout, sizes[:k], slots[:k], flags[:k], nslots, room)
        return int(peak_overshoot) > int(start["peak_overshoot"])

    def need(self, batch_size):
        """The replay at `batch_size` with a budget that always fits: its peaks."""
        sizes, slots, flags, nslots = self._ops(batch_size)
        return _replay(self.layout, sizes, slots, flags, nslots, int(sizes.sum()) * 2 + (1 << 30))

    def fits(self, batch_size, budget, as_run=False):
        return self.replay(batch_size, budget, as_run)["fits"]

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
                 "ev_lo": np.float64, "ev_fixed_hi": np.float64, "ev_hi": np.float64, "ev_square": np.float64}
        return cls(**{k: (np.asarray(v, dtype=types[k]) if k in types and v is not None else v)
                      for k, v in d.items()})


def _replay(layout, sizes, slots, flags, nslots, budget):
    """The ops (StepModel._ops) through the pool's own code under `budget`, laid out as
    `layout` (the recorded pool's): _core.replay_step's dict."""
    return _core.replay_step(sizes, slots, flags, nslots, int(budget), upstream=_replay_upstream(layout),
                             alignment=int(layout.get("alignment", 0)), granule_bytes=_granule(layout),
                             address_factor=int(layout.get("address_factor", 0)),
                             small_threshold=int(layout.get("small_threshold", 0)),
                             zone_threshold=int(layout.get("zone_threshold", 0)))


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
