"""Recording training steps as the pool sees them, for the memory model.

A recorded step is the blocks live when it began (pool.live_blocks()) and the events of
the step (the pool's trace, started at its first allocation and stopped after its last).
While a batch size is being profiled, the TensorFlow plugin tags the kernel allocations
whose first dimension is that batch size (tfmg_set_profile_batch).

fit_steps() runs a short fit() of its own (two steps, the second recorded, or one) and restores
the model's variables and its optimizers' state exactly (_snapshot): the second batch size the memory model
needs, a complete step after an out-of-memory error, and find_batch_size's measurements.
Its steps run as fit() runs them (a lone train_on_batch step runs another graph: its batch
comes from Python, not from fit()'s tf.data pipeline).
"""
import gc
import traceback

from tf_memguard import _backend, _core, _dead_models
from tf_memguard._fit_args import fed_nbytes, first_samples, num_samples, replicas, runnable
from tf_memguard._step_trace import _ALLOC, _FREE, _OVERSHOOT, StepTrace
from tf_memguard._snapshot import Snapshot

# Events one step may leave in the trace: a training step of the models seen makes
# 100-5,000 allocations and as many frees (an LSTM over 64 time steps: about 4,500 of
# each); the first step of a function, with graph optimization, ~20,000 on most, but
# keras.applications' NASNetMobile's (its 771 layers traced at 254 samples of 32x32)
# made about 357,000: some 460 per layer. The largest of keras.applications' graphs,
# NASNetLarge's 1,041 layers, would make about 480,000 at that rate: the capacity holds
# twice that. A step that makes more is not recorded (StepRecorder.end: None): a failed
# step then goes without its model (_after_oom), and a short run's step counts as not
# completed (the answer is lower, never higher). The trace's memory follows the events
# a step makes (56 bytes each): 20 MiB of host memory for NASNetMobile's first step, 56
# MiB at most, outside the budget; a step of 5,000 events takes 0.3 MiB.
TRACE_CAPACITY = 1 << 20


_active = set()  # recorders recording now (a run ended by Ctrl-C may leave one)


def clear_chain(error):
    """Clears the locals of the finished frames of `error`'s traceback and of the errors it
    was raised from or during (Keras re-raises a layer's error as a new one: the frames
    holding PyTorch's activations are in the original's traceback, not in its own)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def abort_all():
    """Stops every recording (and the profiling of a batch size) left by an interrupted run."""
    for recorder in list(_active):
        recorder.abort()
    _core.set_profile_batch(0)


class StepRecorder:
    """Records one step at a time of a pool: begin() at its start, end() after it."""

    def __init__(self, pool, capacity=None):
        self.pool = pool
        self.capacity = TRACE_CAPACITY if capacity is None else capacity
        self._live = None
        self._batch = None

    @property
    def active(self):
        return self._live is not None

    def begin(self, batch_size):
        self._batch = int(batch_size)
        self._live = self.pool.live_blocks()
        self.pool.trace_start(self.capacity)
        _active.add(self)

    def end(self, complete=True):
        """The step recorded since begin() (a StepTrace), or None when the trace lost
        events (a step larger than the trace's capacity)."""
        if self._live is None:
            return None
        self.pool.trace_start(0)
        _active.discard(self)
        live, self._live = self._live, None
        try:
            return StepTrace.from_pool(self.pool, live, self._batch, complete=complete,
                                       ordered=_backend.framework() == "torch")
        except ValueError:
            return None

    def abort(self):
        if self._live is not None:
            self.pool.trace_start(0)
            self._live = None
        _active.discard(self)


_nested = []  # fit_steps() running: MemGuardCallback leaves such steps alone
# The training steps the advice's short runs began in this process, and their samples
# (full batches counted whole): what the advice costs beyond fit() (advice_steps()).
_tally = {"steps": 0, "samples": 0}


def advice_steps():
    """{"steps", "samples"}: the training steps the advice's short fit() runs have begun
    in this process so far (the second batch size, after an out-of-memory error,
    find_batch_size, the confirmation of a suggestion), and the samples they took at most
    (a partial last batch counted whole). benchmarks/advice_overhead.py reads it."""
    return dict(_tally)


def in_own_steps():
    """True while fit_steps() runs a short fit() of its own."""
    return bool(_nested)


def _record_step(recorder, batch_size, at=1, epoch_at=0, full=None):
    """A Keras callback that profiles the batch size from the epoch's start and records the
    step `at` (0-based: by default the second, since the first may trace the step's
    function for the new batch dimension) of the epoch `epoch_at`, and the peak of every
    step of the first `full` of each epoch (those with a full batch; all when None). Made
    on first use: importing tf_memguard imports no Keras."""
    import keras

    def peak():
        s = recorder.pool.stats()
        return max(0, s["window_peak_bytes_in_use"] - s["passthrough_bytes_in_use"])

    class RecordStep(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.trace = None
            self.epoch = 0
            self.peaks = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
            _core.set_profile_batch(batch_size)

        def on_train_batch_begin(self, batch, logs=None):
            _tally["steps"] += 1
            _tally["samples"] += batch_size
            recorder.pool.reset_peak()
            if batch == at and self.epoch == epoch_at:
                recorder.begin(batch_size)

        def on_train_batch_end(self, batch, logs=None):
            if full is None or batch < full:
                self.peaks.append(peak())
            if batch == at and self.epoch == epoch_at and recorder.active:
                self.trace = recorder.end(True)
                if self.trace is not None:
                    # The step's own peak as it ran (its threads' order, the pool's layout):
                    # what the model's replay of it falls short of is kept free (the spread).
                    self.trace.observed_peak = peak()

        def failed(self):
            # Refused in the recorded step, or in a step after it: the run did not complete.
            self.trace = recorder.end(False) if recorder.active else None

    return RecordStep()


def fit_steps(model, x, y, batch_size, recorder, samples=None, steps=2, epochs=1, fit_kwargs=None, waits=False):
    """`steps` steps of fit() at `batch_size` (1 or more), the last recorded (fit()'s own
    pipeline, its copy of the data, the trace of the step it runs): a StepTrace,
    complete=False when the recorded step was refused; None when an earlier one was.
    With `epochs` > 1, that many whole epochs (`steps` is not used), the first step of
    the last one recorded, and None when any step was refused.
    `samples`: fit() on that many of the first samples (default: all; one more than two
    batches makes the last batch partial, and the trace the one for an unknown batch
    dimension). `fit_kwargs`: more of fit()'s arguments (sample_weight, taken as x is;
    class_weight). One step is the first of its fit() at this size: where the function has
    no trace for it yet, the recorded step includes the tracing's own blocks (freed before
    the step's kernels run; a model takes those it cannot match as bounded, never as
    less). The model's weights and optimizer state are restored exactly, its metrics
    reset. Its requests do not wait for frees (the pool's wait is off meanwhile): the
    memory model is of the step as it runs without waits, and a run that completed only
    because its requests waited would prove a size at the budget's very edge (keras.io's
    MNIST convnet after an OOM at 320: short runs at 240 completed with waits, and the
    retry at 240 ran out in 1 of 3 processes; benchmarks/NOTES.md, "Waiting for frees").
    With `waits`, its requests wait as the pool's do: where not even a batch of 1
    completes without (_after_oom.model_after_oom, find_batch_size)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"fit_steps(steps={steps!r}): must be an int of at least 1")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"fit_steps(epochs={epochs!r}): must be an int of at least 1")
    fit_kwargs = dict(fit_kwargs or {})
    # Under a strategy of several replicas only multiples of them run (_fit_args.runnable):
    # the step is recorded at the size that runs, which the trace's batch_size says, and
    # a partial last batch keeps a sample for every replica.
    split = replicas(model)
    if split > 1:
        batch_size = runnable(batch_size, split)
        if samples is not None and 0 < samples % batch_size < split:
            samples = min(samples + split - samples % batch_size, num_samples(x))
    if samples is not None:
        x = first_samples(x, samples)
        y = first_samples(y, samples) if y is not None else None
        if fit_kwargs.get("sample_weight") is not None:
            fit_kwargs["sample_weight"] = first_samples(fit_kwargs["sample_weight"], samples)
    snapshot = Snapshot(model)
    full = num_samples(x) // batch_size
    cb = _record_step(recorder, batch_size, at=steps - 1, full=full) if epochs == 1 else \
        _record_step(recorder, batch_size, at=0, epoch_at=epochs - 1, full=full)
    history = getattr(model, "history", None)
    _nested.append(True)
    gc.collect()
    wait = recorder.pool.wait
    if not waits:
        recorder.pool.set_wait(0)
    # A step refused before this run (the failed fit(), a short run before it) has
    # unwound: with waits, this run's requests wait from its first step on.
    recorder.pool.end_failed_wait()
    dead_watch = _dead_models.Watch()
    try:
        with _OneStepPerExecution(model):
            model.fit(x, y, batch_size=batch_size, epochs=epochs, steps_per_epoch=steps if epochs == 1 else None,
                      verbose=0, shuffle=False, callbacks=[cb], **fit_kwargs)
    except _backend.oom_errors() as e:
        cb.failed()
        clear_chain(e)
        del e
    finally:
        dead_watch.end()
        recorder.pool.set_wait(wait)
        recorder.pool.end_failed_wait()   # this run's refused step has unwound
        _nested.pop()
        recorder.abort()
        _core.set_profile_batch(0)
        snapshot.restore()
        if hasattr(model, "reset_metrics"):
            model.reset_metrics()
        if history is not None:
            model.history = history
        gc.collect()
    if cb.trace is not None and cb.trace.complete:
        cb.trace.step_peaks = tuple(cb.peaks)
    return cb.trace


def without_blocks(trace, sizes, kind=None, tagged=None):
    """`trace` without the blocks live at its start whose size is one of `sizes` (of
    `kind`, tagged or not when given): what a nested fit() found of the run around it
    that the model must not count (the failed fit()'s prepared batches, the nested
    fit()'s own short copy of the data)."""
    import numpy as np

    from tf_memguard._step_trace import kind_of
    sizes = set(int(v) for v in sizes)
    drop = np.isin(trace.start_size, np.array(sorted(sizes), dtype=np.uint64))
    if kind is not None:
        drop &= kind_of(trace.start_flags) == _core.KINDS.index(kind)
    if tagged is not None:
        drop &= ((trace.start_flags & _core.ALLOC_BATCH) != 0) == tagged
    return _without_start(trace, drop)


def _without_start(trace, drop):
    """`trace` without the blocks live at its start that the boolean array `drop` marks."""
    import dataclasses
    keep = ~drop
    # The step's own peak as it ran held the blocks left out (Keras' copy of the arrays
    # lives through every step): without them, so that the spread (what the replay falls
    # short of it) does not count them again.
    peak = max(0, int(trace.observed_peak) - int(trace.start_size[drop].sum())) if trace.observed_peak else 0
    return dataclasses.replace(trace, start_size=trace.start_size[keep], start_flags=trace.start_flags[keep],
                               start_address=trace.start_address[keep], observed_peak=peak)


def without_outer_batches(trace, outer):
    """`trace` (a nested fit()'s step) without the batch-tagged blocks live at its start
    that `outer` (pool.live_blocks() taken before the nested fit() began) already held,
    same address and size: the run around it had prepared them, at its own batch size,
    and a run at the nested size would hold its own instead (the nested fit()'s, in the
    trace too). Scaled from the nested size they counted twice and more: on the zoo's
    wide MLP, three 32 KiB batches of the run at 16, met by the step at 8 and scaled as
    4 KiB a sample, made the model of that step name 109-204 where 348 trains."""
    import numpy as np
    held = set(zip(np.asarray(outer["address"]).tolist(), np.asarray(outer["size"]).tolist()))
    if not held or len(trace.start_size) == 0:
        return trace
    tagged = (trace.start_flags & _core.ALLOC_BATCH) != 0
    drop = tagged & np.array([(a, s) in held for a, s in zip(trace.start_address.tolist(),
                                                            trace.start_size.tolist())], dtype=bool)
    return _without_start(trace, drop) if drop.any() else trace


def prepared_bytes(trace):
    """Bytes of what tf.data had prepared ahead for `trace`'s step: the batch-tagged blocks
    live at its start, and those the step made that were live at its end (batches the
    pipeline prepared during the step itself, which a step that began with none can have
    met at its peak). Of a step refused partway, the blocks at its start only (what it made
    before the refusal is its own activations)."""
    tagged = (trace.start_flags & _core.ALLOC_BATCH) != 0
    if not trace.complete:
        return int(trace.start_size[tagged].sum())
    live = {}
    for op, addr, size, flags in zip(trace.op.tolist(), trace.address.tolist(), trace.size.tolist(),
                                     trace.flags.tolist()):
        if op == _FREE:
            live.pop(addr, None)
        elif op in (_ALLOC, _OVERSHOOT) and flags & _core.ALLOC_BATCH:
            live[addr] = size
    return int(trace.start_size[tagged].sum()) + int(sum(live.values()))


def scaled_peak(trace, factor):
    """The most bytes `trace`'s step had live at once with its batch-tagged blocks (those
    live at its start and those it made) `factor` times their size: how high the step's
    own order of allocations would peak at `factor` times its batch size, without a model.
    Refused requests hold nothing."""
    tagged = (trace.start_flags & _core.ALLOC_BATCH) != 0
    plain = float(trace.start_size[~tagged].sum())
    shaped = float(trace.start_size[tagged].sum())
    best = plain + factor * shaped
    live = {a: (float(v), t) for a, v, t in zip(trace.start_address.tolist(), trace.start_size.tolist(),
                                                  tagged.tolist())}
    for op, addr, size, flags in zip(trace.op.tolist(), trace.address.tolist(), trace.size.tolist(),
                                     trace.flags.tolist()):
        if op == _FREE:
            block = live.pop(addr, None)
            if block is None:
                continue
            if block[1]:
                shaped -= block[0]
            else:
                plain -= block[0]
            continue
        if op not in (_ALLOC, _OVERSHOOT):
            continue
        batch = bool(flags & _core.ALLOC_BATCH)
        live[addr] = (float(size), batch)
        if batch:
            shaped += size
        else:
            plain += size
        best = max(best, plain + factor * shaped)
    return int(best)


# The flags of a batch-shaped block of data live at a step's start, added to a recorded
# step by the models: tf.data's prepared batches it did not meet (bounded by the epoch,
# as the batches it met: StepModel._ops).
BATCH_DATA_FLAGS = _core.ALLOC_BATCH | (_core.KINDS.index("data") << _core.ALLOC_KIND_SHIFT)
# The same for what a model was shown to fall short of per sample (find_batch_size): not
# tf.data's, so not bounded by the epoch (kind "other", which no tagged block the plugin
# records has).
SHORTFALL_FLAGS = _core.ALLOC_BATCH


def unmet_prepared(trace, most):
    """What tf.data had prepared for other steps (`most` bytes at `trace`'s batch size)
    beyond what `trace`'s step met, as one more batch-tagged block live at its start
    ((sizes, flags) for StepModel.build's extra_start), or None. tf.data's autotuned
    buffers fill as the machine lets them: a step can begin with none of the batches
    (three, on the models measured) that the steps around it began with, and a model of it
    alone would leave them out at every batch size."""
    unmet = int(most) - prepared_bytes(trace)
    if unmet < int(trace.layout.get("alignment", 64) or 64):
        return None
    return [unmet], [BATCH_DATA_FLAGS]


# Keras' torch backend makes each batch on the GPU as it fetches it (the array adapter's
# Dataset converts its slice with convert_to_tensor), and a batch before it is freed only
# when Python lets go of it, which the cycle collector can delay: on the H200, the steps
# of five epochs (106 steps each at 195) began with the current batch and 0, 1 or 2 of
# the ones before it (74.7, 83.9, 93.0 MiB in use; a batch is 9.1 MiB), and their peaks
# rose to 9.2 MiB above the second step of a short run. A short run's step can begin
# with none of them: a model of it alone named 195, 201, whose short runs completed and
# whose epochs ran out (benchmarks/NOTES.md, "Batches the cycle collector holds").
STALE_BATCHES = 2


# Keras' torch backend builds a model at its first fit() (and at the first after compile())
# with backend.compute_output_spec, which runs the model on PyTorch's "meta" device and,
# where a layer cannot run there, on the GPU with a batch of the first batch's shape
# (keras/src/backend/torch/core.py, symbolic_call). What that call made is left to the
# cycle collector, and lives into the fit()'s first steps. keras_hub's Qwen3 backbone with
# a language-model head (4 GiB, an H100): a fresh fit() began its first two or three steps
# with that call's logits live (55 x 128 x 8,000 floats at 55: 215 MiB), the steps after
# them without; the advice of a run at 55 took them as a fixed start block and named 113,
# and a fresh fit() at 113, where they are 441 MiB, ran out in 3 of 3 processes (111
# trains). A MemGuardCallback collects them as its fit() begins and keeps their bytes per
# sample, proportional to the batch, in the models (benchmarks/NOTES.md, "keras_hub on
# Keras' torch backend").
_GARBAGE_ATTR = "_tf_memguard_build_garbage_per_sample"


def collect_build_garbage(pool):
    """On Keras' torch backend, at a fit()'s start: gc.collect(), and the bytes it freed from
    `pool` (what the fit()'s build left to the cycle collector). 0 on the other backends,
    where nothing is collected."""
    if _backend.framework() != "torch":
        return 0
    before = int(pool.stats()["bytes_in_use"])
    gc.collect()
    return max(0, before - int(pool.stats()["bytes_in_use"]))


def build_garbage_rate(model, freed, batch_size):
    """Bytes per sample of a fit() build's leftovers: `freed` (collect_build_garbage) over
    the size of the fit()'s first batch, and at least what an earlier fit() of `model` in
    this process measured (a fresh process's first fit() builds again, at its own size;
    this one may not have). Kept on `model`."""
    rate = freed / float(batch_size) if batch_size else 0.0
    rate = max(rate, float(getattr(model, _GARBAGE_ATTR, 0.0) or 0.0))
    if model is not None and rate > 0:
        try:
            object.__setattr__(model, _GARBAGE_ATTR, rate)  # not an attribute Keras tracks or saves
        except (AttributeError, TypeError):
            pass
    return rate


def garbage_at(rate, batch_size):
    """The build's leftovers at `batch_size` (build_garbage_rate's `rate` bytes per sample) as one
    more batch-tagged block at a step's start ((sizes, flags) for StepModel.build's
    extra_start), or None where there are none."""
    size = int(rate * batch_size)
    return ([size], [SHORTFALL_FLAGS]) if size > 0 else None


# Keras' TensorFlow trainer runs the steps of one execution (compile(steps_per_execution=k),
# k > 1) in a tf.while_loop whose loop variables carry the next batch: the loop's body runs
# the step on the batch fetched before and fetches the next one
# (iterator.get_next_as_optional) beside it, so one batch more than a step of its own holds
# can be live at the step's peak (keras/src/backend/tensorflow/trainer.py,
# multi_step_on_iterator). The short runs' steps are one per execution (fit_steps).
LOOP_BATCHES = 1


def stale_batches(x, y, batch_size, model=None):
    """Room for the batches beside a step's own that a short run's step does not show, as
    one more batch-tagged block at its start ((sizes, flags) for StepModel.build's
    extra_start), or None: on Keras' torch backend the STALE_BATCHES batches before it
    that can still be live as it runs; on TensorFlow, with `model`'s steps_per_execution
    above 1, the LOOP_BATCHES batches its loop fetches beside the step. None with neither,
    or no arrays to size a batch by."""
    if x is None:
        return None
    if _backend.framework() == "torch":
        batches = STALE_BATCHES
    elif _backend.framework() == "tensorflow" and steps_per_execution(model) > 1:
        batches = LOOP_BATCHES
    else:
        return None
    epoch = epoch_of(x, y, 1)
    if epoch is None:
        return None
    return [int(batches * epoch[1] * batch_size)], [SHORTFALL_FLAGS]


def steps_per_execution(model):
    """`model`'s compile(steps_per_execution=...) (1 when it has none, or for None)."""
    try:
        return max(1, int(getattr(model, "steps_per_execution", 1) or 1))
    except (TypeError, ValueError):
        return 1  # "auto" before Keras has resolved it: one step per execution until then


class _OneStepPerExecution:
    """Within it, `model` runs one step per execution (its steps_per_execution set to 1,
    and the train function for that in place); its own, and its function, are put back at
    the end. A short run's steps are then one per callback, as fit_steps records them:
    with k steps per execution Keras calls the batch hooks once per execution, with the
    indices of its first and last step (0 and k - 1, then k and 2k - 1, ...), and the step
    fit_steps records (the second) never began. keras.io's MNIST convnet compiled with
    steps_per_execution=8 under 96 MiB: find_batch_size raised "not even a batch of 1
    fits" where 184 trains, and the advice after an OOM named 0. The function made for one
    step per execution is kept on the model for the next short run (a new one would trace
    the step again), until the model is compiled again."""

    _ATTR = "_tf_memguard_one_step_function"

    def __init__(self, model):
        self.model = model
        self.k = steps_per_execution(model) if _backend.framework() == "tensorflow" else 1

    def __enter__(self):
        if self.k > 1:
            m = self.model
            self.saved = m.train_function
            cached = getattr(m, self._ATTR, None)
            config = getattr(m, "_compile_config", None)
            m.steps_per_execution = 1
            m.train_function = cached[1] if cached is not None and cached[0] is config else None
        return self

    def __exit__(self, *exc):
        if self.k > 1:
            m = self.model
            if m.train_function is not None:
                # (object.__setattr__: not an attribute Keras tracks, nor one saved.)
                object.__setattr__(m, self._ATTR, (getattr(m, "_compile_config", None), m.train_function))
            m.steps_per_execution = self.k
            m.train_function = self.saved
        return False


def joined(*extras):
    """The (sizes, flags) extra_start blocks of `extras` together (None ones left out), or
    None."""
    sizes, flags = [], []
    for e in extras:
        if e is not None:
            sizes, flags = sizes + list(e[0]), flags + list(e[1])
    return (sizes, flags) if sizes else None


def epoch_of(x, y, samples):
    """(samples, bytes per sample of one batch, bytes per sample of each array) of the
    epochs fit() runs over the arrays x and y (StepModel.build's `epoch`): what bounds the
    batches tf.data prepares ahead, and what sizes its batches of each array have."""
    import keras
    arrays = [a for a in keras.tree.flatten((x, y)) if a is not None and hasattr(a, "nbytes") and len(a)]
    if not samples or not arrays:
        return None
    per = tuple(float(fed_nbytes(a) / len(a)) for a in arrays)
    return int(samples), float(sum(per)), per
