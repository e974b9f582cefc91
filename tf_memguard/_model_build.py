"""A StepModel from recorded steps: every block of a step as a line in the batch size.

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
"""
import numpy as np

from tf_memguard._memory_model import RUN_SPREAD, StepModel
from tf_memguard._step_trace import _BATCH, _FREE, _MUST, _OVERSHOOT, _REFUSE, _ROWS, _SQUARE, KINDS, kind_of


def build(template, other=None, start=None, observed_peak=None, first=False, extra_start=None,
          epoch=None, order_bytes=0, fresh=None, layout_bytes=0, order_batch=0, unseen_share=RUN_SPREAD,
          steady=None):
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
    `steady`: with `first`, a steady step of the same run, whose start shows what the
    first step made once and kept (kept_state).
    """
    start = start or template
    fixed_kinds = [KINDS.index(k) for k in ("constant", "copy", "tensor", "raw", "data", "input")] if first else ()
    weights = start.start_size[(start.start_flags & _BATCH) == 0]
    # Blocks of 64 KiB and more: small sizes recur everywhere (scalars, shapes).
    fixed_lo, lo, fixed_hi, hi, square = match(template, other, fixed_kinds, weights[weights >= 1 << 16])
    if first and steady is not None:
        for i in kept_state(template, steady, (fixed_lo != fixed_hi) | (lo != hi)):
            fixed_lo[i] = fixed_hi[i] = fixed_lo[i] + lo[i] * template.batch_size
            lo[i] = hi[i] = 0.0
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
    ev_alloc, ev_slot, ev_flags, ev_flo, ev_lo, ev_fhi, ev_hi, ev_sq = [], [], [], [], [], [], [], []
    for i, (op, addr, flags) in enumerate(zip(template.op.tolist(), template.address.tolist(),
                                              template.flags.tolist())):
        if op == _FREE:
            slot = where.pop(addr, None)
            if slot is None:
                continue
            ev_alloc.append(False), ev_slot.append(slot), ev_flags.append(0)
            ev_flo.append(0.0), ev_lo.append(0.0), ev_fhi.append(0.0), ev_hi.append(0.0), ev_sq.append(0.0)
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
        ev_sq.append(square[j])
    model = StepModel(start_fixed=start_fixed, start_slope=start_slope, start_flags=start_flags.copy(),
                ev_alloc=np.array(ev_alloc, dtype=bool), ev_slot=np.array(ev_slot, dtype=np.uint32),
                ev_flags=np.array(ev_flags, dtype=np.uint32), ev_fixed_lo=np.array(ev_flo),
                ev_lo=np.array(ev_lo), ev_fixed_hi=np.array(ev_fhi), ev_hi=np.array(ev_hi),
                ev_square=np.array(ev_sq) if any(ev_sq) else None, nslots=nslots,
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


def match(template, other, fixed_kinds=(), fixed_sizes=()):
    """Per allocation of `template`, its line in the batch size, as two bounds:
    (fixed_lo, slope_lo, fixed_hi, slope_hi), and its bytes per squared sample (`square`:
    0 but for the blocks below). A block with one line has both bounds alike.

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
    - a block with the batch as its second dimension too (tagged TFMG_ALLOC_BATCH_SQUARE:
      batch x batch, as a contrastive loss's similarities of every pair of samples) whose
      size scaled by the square of the batch ratio is there too, and not its size scaled by
      the ratio, grows with the square of the batch (a dimension equals the batch by chance
      often: 32 x 32 images at a batch of 32 tag every activation of the zoo's ResNet,
      whose partners at 16 are proportional). A line through both sizes passes below the
      origin, and such a block was taken as proportional above the recorded size: from a
      run at 808 of a SimCLR-style loss on a dense encoder under 96 MiB the model named
      2,680, whose short runs were refused, and 808 was named where 1,778 trains. Where
      the steps allocate in one order (PyTorch's), a pair of the same place whose sizes
      are in the square of the batch ratio is such a block too (those blocks carry no
      tags).
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
    square = np.zeros_like(size)
    squared = ((flags & _SQUARE) != 0) & (tagged | rows)
    done = np.zeros(len(size), dtype=bool)

    def line(i, fixed, slope):
        fixed_lo[i], slope_lo[i], fixed_hi[i], slope_hi[i] = fixed, slope, fixed, slope
        done[i] = True

    def quadratic(i):
        line(i, 0.0, 0.0)
        square[i] = size[i] / (bt * bt)

    # An untagged block of a weight's size still live at the step's end (see below).
    state = live_at_end(template) & np.isin(size, list(weight_set)) if weight_set else np.zeros(len(size), bool)
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
            elif _in_square_ratio(size[i], o_size[j], bt, bo, align):
                quadratic(i)
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
                if squared[i]:
                    scaled = np.ceil(size[i] * (bo / bt) ** 2 / align) * align
                    if take(scaled, True) or take(scaled - align, True) or take(scaled + align, True):
                        quadratic(i)
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
    return fixed_lo, slope_lo, fixed_hi, slope_hi, square


def kept_state(first, steady, bounded):
    """Of `first`'s allocations (a run's first step) whose line is only bounded (`bounded`,
    per allocation: untagged, no partner at the other size), the indices of those that are
    state made once and kept: not freed by the step's end, and of the size of an untagged
    block a steady step of the run (`steady`) begins with beyond the blocks the first step
    began with. The steady steps' model holds such a start block fixed (untagged), and so
    does the first step's, consistently. On Keras' torch backend cuBLAS makes a 32 MiB
    workspace per thread that runs matmuls in a fit()'s first step and keeps it; bounded,
    keras_hub's Swin Transformer's two (64 MiB at 64) counted 457 MiB at 457, and the first
    step's model named 341 where 457 trains (its steady step's model named 428); with them
    fixed, 428, which trained in 2 of 2 fresh processes on an H100."""
    idx = first.allocations()
    kept = live_at_end(first) & bounded & (first.op[idx] != _REFUSE)
    if not kept.any():
        return []
    extra = {}
    for v in steady.start_size[(steady.start_flags & _BATCH) == 0].tolist():
        extra[int(v)] = extra.get(int(v), 0) + 1
    for v in first.start_size[(first.start_flags & _BATCH) == 0].tolist():
        if extra.get(int(v), 0) > 0:
            extra[int(v)] -= 1
    out = []
    for i in np.flatnonzero(kept).tolist():
        v = int(first.size[idx[i]])
        if extra.get(v, 0) > 0:
            extra[v] -= 1
            out.append(i)
    return out


def _in_square_ratio(a, b, ba, bb, align):
    """Whether a block of `a` bytes at a batch of `ba` and one of `b` at `bb` are one
    tensor of c x batch^2 bytes (each size rounded up to `align`), larger than rounding."""
    r = (ba / bb) ** 2
    return b >= 4 * align and abs(a - b * r) <= align * (1.0 + r)


def live_at_end(trace):
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
    order, aligned on the sequence of their allocations (by kind) and frees (_align)."""
    def events(t):
        token = np.where(t.op == _FREE, 0, 1 + kind_of(t.flags)).astype(np.int64)
        rank = np.full(len(token), -1, dtype=np.int64)
        rank[t.allocations()] = np.arange(len(t.allocations()))
        return token, rank
    a, a_rank = events(template)
    b, b_rank = events(other)
    i, j = _align(a, b)
    keep = (a_rank[i] >= 0) & (b_rank[j] >= 0)
    return list(zip(a_rank[i][keep].tolist(), b_rank[j][keep].tolist()))


# How far _align looks, in tokens, for the two sides to agree again where they part (each
# side; beyond it, the nearest place where the next _KEY tokens agree). A layer's kernels
# make a few events each (an output, a workspace and its free): 64 holds a few layers.
_REACH = 64
# Tokens a resynchronisation key holds (_align): 12 tokens of 5 bits (a free, or 1 + one of
# 16 kinds) in one int64.
_KEY = 12


def _keys(tok):
    n = len(tok) - _KEY + 1
    h = np.zeros(max(n, 0), dtype=np.int64)
    for t in range(_KEY if n > 0 else 0):
        h |= tok[t:t + n].astype(np.int64) << (5 * t)
    return h


def _positions(keys):
    """key -> its positions in `keys`, ascending."""
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    cuts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]]) if len(ks) else np.zeros(0, dtype=np.int64)
    return {int(ks[c]): order[c:e] for c, e in zip(cuts, np.r_[cuts[1:], len(ks)])}


def _next(index, key, at):
    """The first position at or after `at` where `key` begins, or None."""
    pos = index.get(int(key))
    if pos is None:
        return None
    k = int(np.searchsorted(pos, at))
    return int(pos[k]) if k < len(pos) else None


def _run(a, b, i, j):
    """How many tokens from a[i] and b[j] on are equal, compared a chunk at a time."""
    k, chunk, n, m = 0, 256, len(a), len(b)
    while i + k < n and j + k < m:
        size = min(chunk, n - i - k, m - j - k)
        ne = np.flatnonzero(a[i + k:i + k + size] != b[j + k:j + k + size])
        if len(ne):
            return k + int(ne[0])
        k += size
        chunk *= 2
    return k


def _align(a, b):
    """The aligned positions (i, j) of equal tokens of two token sequences. Equal runs pair
    in step; where the sides part, each way on is tried, a token changed in place, up to
    _REACH tokens that one side added, or the nearest place where the one side's next
    _KEY tokens begin again in the other, and the way whose run of equal tokens goes
    furthest is taken (the nearest of those that go as far). Steps of one order differ in a
    few places (a workspace one size asks for), and a step's tokens repeat with its layers,
    so that many ways on agree for a while: the furthest run is the one that ends where
    both sequences end, as difflib's longest match, which was used before and took
    minutes on the 30,000 events of a step of keras.io's MLP-Mixer on PyTorch (few kinds of
    token: the worst case of its search); find_batch_size never returned."""
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    n, m = len(a), len(b)
    ka, kb = _keys(a), _keys(b)
    ia, ib = _positions(ka), _positions(kb)
    out_i, out_j = [], []
    i = j = 0
    while i < n and j < m:
        k = _run(a, b, i, j)
        if k:
            out_i.append(np.arange(i, i + k))
            out_j.append(np.arange(j, j + k))
            i, j = i + k, j + k
        if i >= n or j >= m:
            break
        ways = {(1, 1)}
        ways.update((d, 0) for d in range(1, min(_REACH, n - i - 1) + 1))
        ways.update((0, d) for d in range(1, min(_REACH, m - j - 1) + 1))
        p = _next(ib, ka[i], j + 1) if i < len(ka) else None
        if p is not None:
            ways.add((0, p - j))
        q = _next(ia, kb[j], i + 1) if j < len(kb) else None
        if q is not None:
            ways.add((q - i, 0))
        di, dj = max(ways, key=lambda w: (_run(a, b, i + w[0], j + w[1]), -(w[0] + w[1])))
        i, j = i + di, j + dj
    if not out_i:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(out_i), np.concatenate(out_j)
