"""find_batch_size(): the largest batch size that fits, from the memory model of two
recorded steps of fit(), without a full run."""
from tf_memguard import _backend, _core, _install
from tf_memguard._memory_model import StepModel
from tf_memguard._recording import (Snapshot, StepRecorder, abort_all, fit_steps, prepared_bytes, unmet_prepared,
                                    without_blocks)
from tf_memguard._units import format_bytes, parse_bytes


# The steps the last call recorded (StepTraces, None for a step refused in its first),
# for diagnosis (benchmarks/gpu/keras_torch.py keeps them).
last_steps = []


def find_batch_size(model, x, y=None, max_bytes=None, device=None, steps=4, start=None):
    """The largest batch size whose training step fits the budget, by the memory model.

    Short runs of fit() (two steps each: the first traces the step for its batch size,
    the second is recorded as the pool sees it, with fit()'s own pipeline; on TensorFlow
    without Keras' copy of the arrays, which is in the pool in some runs and not in others,
    and for which the budget is asked with room): at a small size (`start`, default 32 or fewer samples), then where the model
    of the steps that completed says the limit is, as `steps` allow. A size that is
    refused shows the model wrong near it: the next run is halfway to it, and the answer
    the largest size that completed. Every block of the step becomes a line in the batch
    size, and the step scaled to a candidate size is replayed through the pool's own code
    (benchmarks/NOTES.md, "How the advice works"); the answer is the largest size whose
    replay fits. The model's weights and optimizer state are restored exactly afterwards;
    its metrics are reset.

    Args:
        model: a compiled Keras model.
        x: the training inputs (arrays, or a structure of arrays, as for fit()).
        y: the targets. Defaults to None.
        max_bytes: the budget to fit, as for install(). Defaults to the installed one.
        device: Defaults to the device install() was called for (else "CPU:0" on
            TensorFlow, "GPU:0" on Keras' torch backend).
        steps: the most training steps to run (2 per batch size tried, at least 2).
            Defaults to 4.
        start: the first batch size tried. Defaults to 32 (or fewer samples).

    On Keras' JAX backend no step is run: the train step XLA compiles at a batch size
    gives its memory (memory_analysis()), and the answer is the largest size whose
    compiled step, with what is live beside it, fits (at most 5 compilations; `steps` is
    not used).

    Returns:
        The batch size (an int).

    Raises:
        ValueError: the model is not compiled, there is no budget, or x is empty.
        tf_memguard.OutOfBudgetError: not even the first batch size tried fits; the
            message says which budget would.

    Example:
        >>> tf_memguard.install(max_bytes="1GiB")
        >>> size = tf_memguard.find_batch_size(model, x_train, y_train)
        >>> model.fit(x_train, y_train, batch_size=size)
    """
    import keras
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError("find_batch_size(model=...): compile the model first (model.compile(...))")
    n = min(len(a) for a in keras.tree.flatten(x))
    if n < 1:
        raise ValueError("find_batch_size(x=...): x holds no samples")
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
    copies = [-(-int(a.nbytes) // align) * align for a in _arrays((x, y))] \
        if _backend.framework() == "tensorflow" else []

    def steps_at(size):
        trace = fit_steps(model, x, y, size, recorder)
        return without_blocks(trace, copies, kind="input") if trace is not None else None
    room = budget - sum(copies)
    try:
        b1 = min(int(start) if start else 32, n)
        first = steps_at(b1)
        snapshot.restore()
        if first is None or not first.complete:
            m = StepModel.build(first, None) if first is not None else None
            need = f"; it needs more than {format_bytes(m.need(b1)['peak_account'] + sum(copies))}" if m else ""
            raise _core.OutOfBudgetError(f"find_batch_size: not even a batch of {b1} fits the {format_bytes(budget)} "
                                         f"budget with this data{need}; pass a larger max_bytes or a smaller start")
        # Each next size is where the model of the steps that completed says the limit is;
        # after a refusal there (the model wrong near it), halfway to it, and the answer is
        # then the largest size that completed.
        # What tf.data had prepared ahead, per sample, the most any complete step met:
        # each short run's second step can begin with all, some or none of the batches
        # prepared (tf.data's autotuned buffers fill as the machine lets them), and a line
        # through a step with them and one without leaves them out of larger sizes.
        per_sample = [prepared_bytes(first) / b1]

        def build(template, other=None):
            extra = unmet_prepared(template, max(per_sample) * template.batch_size)
            return StepModel.build(template, other, extra_start=extra)
        good, current = first, build(first)
        too_large, refused, used = n + 1, False, 2
        last_steps.clear()
        last_steps.append(first)
        while used + 2 <= steps:
            if refused:
                size = (good.batch_size + too_large) // 2
            else:
                size = min(current.largest_fitting(room, at_most=n), too_large - 1)
            if size <= good.batch_size:
                break
            trace = steps_at(size)
            snapshot.restore()
            used += 2
            last_steps.append(trace)
            if trace is not None and trace.complete:
                lower, good = good, trace
                per_sample.append(prepared_bytes(good) / good.batch_size)
                current = build(good, lower)
            else:
                too_large, refused = size, True
        if refused:
            size = good.batch_size
        else:
            size = max(good.batch_size, min(current.largest_fitting(room, at_most=n), too_large - 1))
    finally:
        abort_all()
        snapshot.restore()
        if hasattr(model, "reset_metrics"):
            model.reset_metrics()
        if budget != previous and previous:
            pool.set_limit(previous)
    return max(1, int(size))


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
    size, model_ = _xla_step.find(model, x, y, budget, device, n, start)
    if size < 1:
        raise _core.OutOfBudgetError(
            f"find_batch_size: not even a batch of 1 fits the {format_bytes(budget)} budget by the compiled step: "
            f"it needs about {format_bytes(model_.budget_for(1))}; pass a larger max_bytes")
    return int(size)
