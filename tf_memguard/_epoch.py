"""Keras' batches over an epoch of arrays, in a StepModel's step: which blocks they are,
and what the epoch allows of them at another batch size (StepModel._ops).

Keras makes an iterator per epoch over arrays. At batch size b the epoch has floor(n / b)
full batches and, where b does not divide n, one partial batch of n mod b samples; tf.data
prepares them ahead of the steps that use them. A recorded step meets some of them; scaled
to another batch size, what it met is bounded by what that epoch holds.
"""
import numpy as np

from tf_memguard import _core

_BATCH = _core.ALLOC_BATCH


def _kind(flags):
    return (np.asarray(flags, dtype=np.uint32) >> _core.ALLOC_KIND_SHIFT) & 15


def bounded(model, b, st, ev):
    """The sizes at batch size `b` of the start blocks `st` and the events `ev`, with
    Keras' batches over the epoch's arrays as the epoch allows them.

    The partial batch is untagged (its first dimension is not b). A step meets its own batch and
    those tf.data prepared ahead (live at its start, or made during it and not freed;
    see prepared), at most the epoch's full batches; and where no batch is live at
    its start, the step made its own during it (and freed it), so those it prepared are
    at most the others. Scaled to b, what the recorded step held can pass that: on the
    zoo's autoencoder (2,048 samples) the run's first step at 569 made the whole epoch
    (three full batches and the partial one of 341), which at 1,139 would be three
    batches of 1,139 where the epoch has one and a partial one of 909. The partial
    batch's blocks take its size at b where larger (array_batches)."""
    full_st, full_ev = prepared(model)
    rest = float(model.samples % max(int(b), 1))
    unsized = rest  # the partial batch at b, where the step's blocks do not size it
    if model.array_bytes:
        # Never below its recorded size: a block of a weight's size can pass for a partial
        # batch (the zoo's wide MLP at 128 made Adam's slots of a 8,192 x 128 kernel, as
        # large as 128 samples of its 8,192 features), and a weight does not shrink.
        part_st, part_ev, per_st, per_ev = array_batches(model)
        st = np.where(part_st, np.maximum(st, rest * per_st), st)
        ev = np.where(part_ev, np.maximum(ev, rest * per_ev), ev)
        if part_st.any() or part_ev.any():
            unsized = 0.0
    held = float(st[full_st].sum() + ev[full_ev].sum())
    # The share of the step's own batch it made during it: tf.data hands batches out in
    # the order it made them, so what was live at the recorded start is the step's own
    # batch first (blocks added to the start are batches other steps met, or room: not
    # this step's). (Left out only where the partial batch is sized too: a model saved
    # without the arrays' sizes keeps the older bound, which its partial batch, scaled
    # as a line, needs.)
    own = 0.0
    if model.array_bytes:
        b0 = float(model.base_batch)
        recorded = full_st.copy()
        recorded[len(recorded) - model.added_start:] = False
        at_start = float((model.start_fixed[recorded] + model.start_slope[recorded] * b0).sum())
        own = max(0.0, 1.0 - at_start / (model.batch_bytes_per_sample * b0))
    # (A step that met no partial batch, at a size that divides the samples, or before
    # tf.data made it: at b the held blocks may be it, for all the model knows.)
    batches = model.samples // max(int(b), 1) - own
    most = model.batch_bytes_per_sample * (b * max(batches, 0.0) + (unsized if model.array_bytes else 0.0))
    if held > most:
        f = most / held
        st = np.where(full_st, st * f, st)
        ev = np.where(full_ev, ev * f, ev)
    return st, ev


def prepared(model):
    """Which blocks are tf.data's batches (as _recording.prepared_bytes counts them): the
    batch-tagged blocks live at the step's start, and the batch-tagged blocks the step
    makes and does not free (batches prepared during it; a Keras pipeline that shuffles
    makes them in a map function's kernels, not as kind "data"). Masks of the start
    blocks and of the events."""
    # (Not kind "other": the plugin tags only blocks whose request it knows; a tagged block
    # of kind "other" is a model's own correction, find_batch_size's shortfall.)
    start = ((model.start_flags & _BATCH) != 0) & (model.start_slope > 0) & (_kind(model.start_flags) != 0)
    freed = np.zeros(model.nslots, dtype=bool)
    freed[model.ev_slot[~model.ev_alloc]] = True
    made = model.ev_alloc & ((model.ev_flags & _BATCH) != 0) & (model.ev_hi > 0) & ~freed[model.ev_slot]
    return start, made


def array_batches(model):
    """The epoch's partial batch among the blocks of `model`'s step (untagged: its first
    dimension is not the batch size), live at its start or made and not freed: blocks of
    64 KiB or more (smaller sizes recur everywhere) whose size is n mod b0 times one
    array's bytes per sample, within the pool's alignment (b0: the recorded batch size).
    Masks of the start blocks and the events, and per block its array's bytes per sample
    (0 where none). (Untagged blocks of a full batch's size are not taken as batches:
    tf.data's batches made while a size is profiled are tagged, and the untagged ones of
    that size met were a folded constant, the autoencoder's at 512, and Adam's slots of
    the wide MLP's first kernel at 128.)"""
    rest = model.samples % max(int(model.base_batch), 1)
    b0 = float(model.base_batch)
    tol = max(int(model.layout.get("alignment", 64) or 64), 64)
    per = np.asarray(model.array_bytes, dtype=np.float64)
    freed = np.zeros(model.nslots, dtype=bool)
    freed[model.ev_slot[~model.ev_alloc]] = True

    def which(sizes, candidates):
        if not rest or not len(per):
            return np.zeros(len(sizes), dtype=bool), np.zeros(len(sizes))
        d = np.abs(sizes[:, None] - rest * per[None, :])
        part = candidates & (sizes >= 1 << 16) & (d.min(axis=1) <= tol)
        return part, np.where(part, per[d.argmin(axis=1)], 0.0)
    s_part, s_per = which(model.start_fixed + model.start_slope * b0, (model.start_flags & _BATCH) == 0)
    e_part, e_per = which(model.ev_fixed_hi + model.ev_hi * b0,
                          model.ev_alloc & ((model.ev_flags & _BATCH) == 0) & ~freed[model.ev_slot])
    return s_part, e_part, s_per, e_per
