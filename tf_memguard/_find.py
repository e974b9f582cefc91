"""find_batch_size(): the largest batch size that fits, from the memory model of two
recorded steps of fit(), without a full run."""
from tf_memguard import _backend, _core, _install
from tf_memguard._fit_args import fed_nbytes, fixed_batch_size, is_sliceable, num_samples, replicas, round_down
from tf_memguard._memory_model import ONE_DRAW_SPREAD, StepModel, StepModels
from tf_memguard._recording import (SHORTFALL_FLAGS, StepRecorder, abort_all, epoch_of, fit_steps, joined,
                                    prepared_bytes, stale_batches, unmet_prepared, without_blocks)
from tf_memguard._snapshot import Snapshot
from tf_memguard._units import format_bytes, parse_bytes


# Steps at the first size tried, the last recorded. One: the step that traces the train
# function, whose tracing blocks are freed before its kernels run (the optimizer is built
# before it, as fit() builds it: Snapshot), as for the callback's second size
# (_steps.LONE_STEPS). Two, the first thrown away, left one size fewer within `steps`
# (benchmarks/NOTES.md, "find_batch_size: one step at the first size too"). On Keras'
# torch backend too, where the first step also makes cuBLAS's workspace: on an H100 the
# same answer with one as with two (187, trained 3 of 3 each; 197 trains), from sizes 32,
# 136, 189 rather than 32, 192 (results/gpu_keras_torch_find.json).
FIRST_STEPS = 1

# The steps the last call recorded (StepTraces, None for a step refused in its first),
# for diagnosis (benchmarks/gpu/keras_torch.py keeps them).
last_steps = []


def find_batch_size(model, x, y=None, max_bytes=None, device=None, steps=4, start=None, validation_data=None,
                    sample_weight=None, class_weight=None):
    """The largest batch size whose training step fits the budget, by the memory model.

    Short runs of fit(), each step recorded as the pool sees it, with fit()'s own pipeline
    (on TensorFlow without Keras' copy of the arrays, which is in the pool in some runs and
    not in others, and for which the budget is asked with room): one step at a small size
    (`start`, default 32 or fewer samples; it traces the step, and is recorded as it
    runs), then one step at each next size, where the model of the two largest steps that
    completed says the limit is, as `steps` allow; on TensorFlow with 1/7 of the step's
    growth kept free for the orders of the kernels one step does not show
    (ONE_DRAW_SPREAD). A
    size that is refused shows the model short near it: the next size is where the model,
    with that shortfall per sample added, says the limit is, but at most halfway from the
    largest size that completed to the smallest refused. Every block of the step becomes
    a line in the batch size, and the step scaled to a candidate size is replayed through
    the pool's own code (benchmarks/NOTES.md, "How the advice works"); the answer is the
    largest size whose replay fits, below every size refused. The steps' requests do
    not wait for frees (the model is of the step as it runs without waits), unless not
    even a batch of 1 completes without: then they wait, as fit()'s will. The model's
    weights and optimizer state are restored exactly afterwards; its metrics are reset.

    Args:
        model: a compiled Keras model.
        x: the training inputs (arrays, or a structure of arrays, as for fit()).
        y: the targets. Defaults to None.
        max_bytes: the budget to fit, as for install(). Defaults to the installed one.
        device: Defaults to the device install() was called for (else "CPU:0" on
            TensorFlow, "GPU:0" on Keras' torch backend).
        steps: the most training steps to run (one at each batch size tried; at least
            2). Defaults to 4: four sizes.
        start: the first batch size tried. Defaults to 32 (or fewer samples); where
            that does not fit, it is halved until its step completes (one step at each
            size tried, not counted in `steps`), and the answer lies below the sizes
            refused.
        validation_data: the validation arrays the fit() will be given, as for fit():
            (x_val, y_val) or (x_val, y_val, sample_weight_val). Keras copies them into
            tensors at the first evaluation and keeps the copy until fit() returns, so
            the training steps of every epoch after the first run beside it: the answer
            leaves room for it (on TensorFlow; on Keras' torch and JAX backends the
            arrays stay in host memory, outside the budget). Defaults to None. With
            validation_split, pass x and y whole: Keras' copies of the two parts add up
            to one of the arrays, for which the room is kept anyway.
        sample_weight, class_weight: as for fit() (a weight per sample of x; a dict of
            class index to weight): the short runs are given them, as the run will be.
            Defaults to None. (Not used on Keras' JAX backend, where no step runs.)

    On Keras' JAX backend no step is run: the train step XLA compiles at a batch size
    gives its memory (memory_analysis()), and the answer is the largest size whose
    compiled step, with what is live beside it, fits (at most 5 compilations; `steps` is
    not used).

    Returns:
        The batch size (an int).

    A model whose inputs fix the batch size (keras.Input(batch_shape=(B, ...)), as a
    stateful recurrent layer needs) runs no other: its one step at B is run, and B is
    the answer if it fits.

    Raises:
        ValueError: the model is not compiled, there is no budget, x is empty, or x
            or validation_data is not arrays (a tf.data dataset, a generator, a
            PyDataset: their batches are their own).
        tf_memguard.OutOfBudgetError: not even the first batch size tried fits (`start`
            given), or not even a batch of 1 (`start` left to its default), or the batch
            size the model's inputs fix; the message says which budget would.

    Example:
        >>> tf_memguard.install(max_bytes="1GiB")
        >>> size = tf_memguard.find_batch_size(model, x_train, y_train)
        >>> model.fit(x_train, y_train, batch_size=size)
    """
    _backend.require_keras3_model(model, "find_batch_size")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError("find_batch_size(model=...): compile the model first (model.compile(...))")
    for name, data in (("x", x), ("y", y)):
        if (data is not None or name == "x") and not is_sliceable(data):
            raise ValueError(
                f"find_batch_size({name}=<{type(data).__name__}>): takes arrays (numpy arrays or tensors, or a "
                "structure of them, as fit(x, y) does), whose batch size it can choose; a tf.data dataset, "
                "generator or PyDataset fixes "
                "its own batches. Pass the arrays, or train on the dataset with MemGuardCallback, whose warning "
                "and report name the batch size that fits")
    val = _validation_arrays(validation_data)
    n = num_samples(x)
    if n < 1:
        raise ValueError("find_batch_size(x=...): x holds no samples")
    weights = _weights(sample_weight, class_weight, n)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"find_batch_size(steps={steps!r}): must be an int of at least 2")
    if _backend.framework() == "jax":
        return _find_xla(model, x, y, max_bytes, device, n, start)
    device = _install.resolve_device(device)
    pool = _install.device_pool(device)
    installed = _install.config(device)
    if max_bytes is None and installed is None:
        raise ValueError("find_batch_size(max_bytes=None): no budget to fit; pass max_bytes or call "
                         "tf_memguard.install() first")
    budget = installed.max_bytes if max_bytes is None else parse_bytes(max_bytes, pool.total_memory())
    if installed is None:
        _install.install(budget, device)
    previous = pool.stats()["bytes_limit"]
    if budget != previous:
        pool.set_limit(budget)
    snapshot = Snapshot(model)
    recorder = StepRecorder(pool)
    align = int(pool.layout().get("alignment", 64) or 64)
    # Keras' copy of the arrays is in the pool in some runs and not in others (a numpy
    # array aligned as TensorFlow wants becomes a tensor without a copy, and which arrays
    # Keras converts varies): in the small CNN's runs the 12 MiB copy was live at the start
    # of the step at 32 and missing at 75, a line through them made the copy shrink with
    # the batch, and 419 was named where 370 was the most that trained. The steps are
    # taken without it, and the budget is asked with room for it: the real run may copy.
    # (On Keras' torch backend the arrays stay on the host: no copy in the pool.)
    copies = [-(-fed_nbytes(a) // align) * align for a in _arrays((x, y, sample_weight))] \
        if _backend.framework() == "tensorflow" else []
    # The validation arrays' copy, made at the first evaluation, is live at the steps of
    # every epoch after it (benchmarks/NOTES.md, "find_batch_size and the validation
    # arrays"): room for it too. (The short runs have no validation: nothing to take out.)
    val_copies = [-(-fed_nbytes(a) // align) * align for a in _arrays(val)] \
        if _backend.framework() == "tensorflow" else []

    waits_now = [False]  # the steps' requests wait as the pool's do (first_step), else not

    def steps_at(size, steps):
        trace = fit_steps(model, x, y, size, recorder, steps=steps, fit_kwargs=weights, waits=waits_now[0])
        return without_blocks(trace, copies, kind="input") if trace is not None else None
    held = sum(copies) + sum(val_copies)
    room = budget - held
    first_steps = FIRST_STEPS
    # fit() at the answer runs epochs over the arrays, whose prepared batches they bound.
    epoch = epoch_of(x, y, n) if _backend.framework() == "tensorflow" else None
    fixed = fixed_batch_size(model)
    if fixed is not None:
        # The only size the model runs: one step at it, and no other size tried.
        start, steps = fixed, first_steps
    try:
        def run_at(size, waits):
            waits_now[0] = waits
            trace = steps_at(size, first_steps)
            snapshot.restore()
            return trace
        # The default first size is a guess, not the user's: a model whose limit lies
        # below it (a transformer over long sequences, a segmentation network at a large
        # image size) gets its size from halving it until its step completes, each size
        # refused a bound on the answer. An explicit `start` that does not fit raises.
        first, b1, refused, _ = first_step(min(int(start) if start else 32, n), not start, run_at, pool.wait > 0)
        refused = n + 1 if refused is None else refused
        if first is None or not first.complete:
            m = StepModel.build(first, None) if first is not None else None
            need = f"; it needs more than {format_bytes(m.need(b1)['peak_account'] + held)}" if m else ""
            if fixed is not None:
                raise _core.OutOfBudgetError(
                    f"find_batch_size: the model's inputs fix the batch size at {fixed} (keras.Input(batch_shape="
                    f"...)), the only one it can run, and it does not fit the {format_bytes(budget)} budget with "
                    f"this data{need}; pass a larger max_bytes, or build the model's inputs for a smaller batch size")
            raise _core.OutOfBudgetError(f"find_batch_size: not even a batch of {b1} fits the {format_bytes(budget)} "
                                         f"budget with this data{need}; pass a larger max_bytes"
                                         + (" or a smaller start" if b1 > 1 else ""))
        # What tf.data had prepared ahead, per sample, the most any complete step met:
        # each short run's recorded step can begin with all, some or none of the batches
        # prepared (tf.data's autotuned buffers fill as the machine lets them; a run of one
        # step begins as its pipeline starts), and a line through a step with them and one
        # without leaves them out of larger sizes.
        per_sample = [prepared_bytes(first) / b1]
        # What the model was shown to fall short of, per sample: a step refused at a size
        # the model said fits needed more than the room, by at least what the model's
        # replay there leaves of it. Kept as one more batch-tagged block at the start.
        short = 0.0

        def one(template, other):
            extra = joined(unmet_prepared(template, max(per_sample) * template.batch_size),
                           ([int(short * template.batch_size)], [SHORTFALL_FLAGS])
                           if short * template.batch_size >= align else None,
                           stale_batches(x, y, template.batch_size, model))
            # Each size is one step, the first of its short fit(): one draw of the orders,
            # which fit()'s later steps at that size can peak well above (ONE_DRAW_SPREAD).
            return StepModel.build(template, other, extra_start=extra, epoch=epoch, unseen_share=ONE_DRAW_SPREAD)

        def build(template, other=None):
            # Each step's kernels ran in one order of the many TensorFlow's threads draw,
            # and the replay scales the template's order: both steps' orders must fit. On
            # the README's CNN under 128 MiB a step at 554 peaked at 114.1 MiB where steps
            # at 389 peaked at 95.5-111.7 (the line through 76 and 389 gives 141), and the
            # model of its order named 472, which ran out; the order of the step at 76,
            # scaled, named 389-413 where the larger step's named 396-525.
            if other is None:
                return one(template, None)
            return StepModels([one(template, other), one(other, template)])
        # Every size runs one step, recorded as it traces or not (FIRST_STEPS): four sizes within four steps, the last one near the limit, so
        # that the answer needs little extrapolation (from steps at 32 and 185, a line named 456 for the zoo's
        # two-input model, where 432 was the most that trained). Each next size is where
        # the model of the two largest steps that completed says the limit is; after a
        # refusal, where that model says it is with what it was shown to fall short of, but
        # no more than halfway to the refused size.
        # The shortfall is this model's, at every size refused, worked out afresh for each
        # model: a step that completed after a refusal can show what the refused step met
        # (a workspace taken only above some size), and a shortfall kept from the earlier
        # model then counts it twice. A test's model with a 100 MiB workspace above 200
        # samples under 160 MiB: after 32 and 78 completed, 252 was refused (short by about
        # 0.4 MiB a sample), then 165 and 208 completed, the workspace in 208's step; with
        # the old shortfall kept, the answer was 97, under sizes that completed.
        refusals = []

        def modelled(template, other=None):
            nonlocal short
            short = 0.0
            models = build(template, other)
            fell = max([(room - models.need(r)["peak_account"]) / r for r in refusals], default=0.0)
            if fell <= 0:
                return models
            short = fell
            return build(template, other)

        good, lower, too_large, used = first, None, refused, first_steps
        if too_large <= n:  # refused in the halving above: the model fell short there
            refusals.append(too_large)
        current = modelled(first)
        last_steps.clear()
        last_steps.append(first)
        while used + 1 <= steps:
            size = min(current.largest_fitting(room, at_most=n), too_large - 1)
            if too_large <= n:
                # After a refusal the model was shown wrong near there: the next size is at
                # most halfway from the largest that completed to the smallest refused (a
                # bisection's guarantee). The model's own corrections fell short three times
                # in a row on the zoo's embedding model under 76 MiB (1,283, 1,063 and 1,034
                # refused after 32, where 823 trains), and with no step completed after the
                # first the answer was 32 (benchmarks/NOTES.md, "find_batch_size after a
                # refusal").
                size = min(size, (good.batch_size + too_large) // 2)
                if size <= good.batch_size:
                    # The model sees no room above what completed: halfway, as bisection would.
                    size = (good.batch_size + too_large) // 2
            if size <= good.batch_size:
                break
            trace = steps_at(size, 1)
            snapshot.restore()
            used += 1
            last_steps.append(trace)
            if trace is not None and trace.complete:
                lower, good = good, trace
                per_sample.append(prepared_bytes(good) / good.batch_size)
            else:
                too_large = size
                refusals.append(size)
            current = modelled(good, lower)
        # The answer is the model's, below every size refused and at most the largest size
        # whose step completed: the model picks where to look, the runs decide (as after an
        # out-of-memory error, _steps.model_after_oom). A step's peak moves with the order
        # TensorFlow's threads run its kernels (the zoo's separable CNN at 341: 257 to 305
        # MiB over one run's steps), so one step that peaked low says too much: on the zoo's
        # mixed-precision model, a step at 717 that peaked at 160 MiB where others at 717
        # peaked at 203 made the model name 901, which ran out in its first step (817 was
        # the most that trained). It may be below the last size that completed (a step that
        # ran without Keras' copy of the arrays, for which the room is kept).
        size = min(current.largest_fitting(room, at_most=n), too_large - 1, good.batch_size)
        split = replicas(model)
        if size >= split:
            size = round_down(size, split)  # a size the strategy's replicas can split
        if fixed is not None and size < fixed:
            raise _core.OutOfBudgetError(
                f"find_batch_size: the model's inputs fix the batch size at {fixed} (keras.Input(batch_shape=...)), "
                f"the only one it can run; its step ran, but with room for Keras' copy of the data"
                f"{_copies_of(val)} ({format_bytes(held)}) it does not fit the {format_bytes(budget)} "
                f"budget; pass a larger max_bytes")
        if size < 1:
            raise _core.OutOfBudgetError(
                f"find_batch_size: a batch of {good.batch_size} ran, but not even a batch of 1 fits the "
                f"{format_bytes(budget)} budget with room for Keras' copy of the data{_copies_of(val)} "
                f"({format_bytes(held)}); pass a larger max_bytes")
    finally:
        abort_all()
        snapshot.restore()
        if hasattr(model, "reset_metrics"):
            model.reset_metrics()
        if budget != previous and previous:
            pool.set_limit(previous)
    return max(1, int(size))


def first_step(size, halving, run_at, can_wait):
    """find_batch_size's first step: at `size`, and while it is refused, at half the size
    (where `halving`: the default start, not the user's) down to 1 (`run_at(size, waits)`:
    the recorded step, complete or not, or None). Its requests do not wait for frees
    (_recording.fit_steps); where not even the last size tried completes and `can_wait`
    (fit()'s requests will wait), the same again with waits, and every step after it
    waits too: fixed workspaces that meet whatever the batch size (see
    _after_oom.descend). Returns (the last step, its size, the smallest size refused
    or None, whether the steps wait)."""
    for waits in (False, True) if can_wait else (False,):
        b, refused = size, None
        trace = run_at(b, waits)
        while (trace is None or not trace.complete) and halving and b > 1:
            refused, b = b, b // 2
            trace = run_at(b, waits)
        if trace is not None and trace.complete:
            return trace, b, refused, waits
    return trace, b, refused, bool(can_wait)


def _validation_arrays(data):
    """The arrays of find_batch_size's `validation_data` (a list, empty for None)."""
    import keras
    if data is None:
        return []
    leaves = [a for a in keras.tree.flatten(data) if a is not None] if isinstance(data, (tuple, list)) else []
    if not leaves or not all(is_sliceable(a) for a in leaves):
        raise ValueError(
            f"find_batch_size(validation_data=<{type(data).__name__}>): takes the validation arrays as fit() "
            "does, (x_val, y_val) or (x_val, y_val, sample_weight_val), numpy arrays or tensors; for a dataset, "
            "train with MemGuardCallback, whose advice counts what the run holds")
    return leaves


def _weights(sample_weight, class_weight, n):
    """fit()'s sample_weight and class_weight for the short runs (a dict), checked."""
    kw = {}
    if sample_weight is not None and class_weight is not None:
        raise ValueError("find_batch_size(sample_weight=..., class_weight=...): pass one of them, as fit() takes "
                         "one (fold the class weights into the sample weights)")
    if sample_weight is not None:
        if not is_sliceable(sample_weight) or num_samples(sample_weight) != n:
            raise ValueError(f"find_batch_size(sample_weight=<{type(sample_weight).__name__}>): takes one weight per "
                             f"sample of x ({n}), an array, as fit() does")
        kw["sample_weight"] = sample_weight
    if class_weight is not None:
        if not isinstance(class_weight, dict):
            raise ValueError(f"find_batch_size(class_weight=<{type(class_weight).__name__}>): takes a dict of class "
                             "index to weight, as fit() does")
        kw["class_weight"] = class_weight
    return kw


def _copies_of(val):
    return " and of the validation arrays" if val else ""


def _arrays(data):
    import keras
    return [a for a in keras.tree.flatten(data) if a is not None and hasattr(a, "nbytes")]


def _find_xla(model, x, y, max_bytes, device, n, start):
    from tf_memguard import _xla_step
    device = _install.resolve_device(device)
    installed = _install.config(device)
    if max_bytes is None and installed is None:
        raise ValueError("find_batch_size(max_bytes=None): no budget to fit; pass max_bytes or call "
                         "tf_memguard.install() first")
    budget = installed.max_bytes if max_bytes is None else parse_bytes(max_bytes, installed.total_memory
                                                                       if installed else 1 << 40)
    fixed = fixed_batch_size(model)
    size, model_ = _xla_step.find(model, x, y, budget, device, n, start, fixed=fixed)
    if size < 1 and fixed is not None:
        raise _core.OutOfBudgetError(
            f"find_batch_size: the model's inputs fix the batch size at {fixed} (keras.Input(batch_shape=...)), the "
            f"only one it can run, and by the compiled step it needs about {format_bytes(model_.budget_for(fixed))}, "
            f"more than the {format_bytes(budget)} budget; pass a larger max_bytes, or build the model's inputs for "
            "a smaller batch size")
    if size < 1:
        raise _core.OutOfBudgetError(
            f"find_batch_size: not even a batch of 1 fits the {format_bytes(budget)} budget by the compiled step: "
            f"it needs about {format_bytes(model_.budget_for(1))}; pass a larger max_bytes")
    return int(size)
