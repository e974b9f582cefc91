"""Batch-size advice: a memory model of a training step, and trial steps that confirm it.

The memory a training step needs is not proportional to the batch: weights, optimizer
slots and Keras' copy of a numpy training set stay, and some kernels take fixed
workspaces (TensorFlow's Conv2DBackpropFilter: ~20 MB whatever the batch). So the model
is ``peak(b) = fixed + per_sample * b``, fitted from measured step peaks. Measured curves
are concave (the per-sample slope falls as the batch grows), so a line fitted from
points below the target over-estimates what a larger batch needs (safe), and the slope
at the current size is what a smaller batch saves.

Sources of points, best first: steps measured at two or more batch sizes (a run's full
and last partial batches, earlier fit() calls, trial steps); otherwise one measured step,
whose peak the pool splits into bytes of tensors with the batch as first dimension and
the rest (the plugin tags them while profiling).
"""
import contextlib
import dataclasses
import gc

from tf_memguard import _backend, _core


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured training step."""

    batch_size: int
    peak_bytes: int           # the step's peak of bytes in use
    batch_bytes: int = 0      # of which tensors with the batch as first dimension
    base_bytes: int = 0       # bytes in use before the step (weights, optimizer, data)
    fits: bool = True         # False: the step was refused (peak_bytes is a lower bound)
    max_batch_bytes: int = 0  # the most batch-shaped bytes live at once in the step
    in_use_at_max_batch: int = 0  # bytes in use at that moment

    def split_estimate(self, batch_size):
        """Peak at another batch size from this step alone: the step's two critical
        moments (its peak, and when the most batch-shaped bytes were live), each with
        its batch-shaped part scaled. Optimistic: not every batch-dependent buffer has
        the batch as first dimension."""
        scale = batch_size / self.batch_size
        at_peak = self.peak_bytes - self.batch_bytes + self.batch_bytes * scale
        at_batch = self.in_use_at_max_batch - self.max_batch_bytes + self.max_batch_bytes * scale
        return max(at_peak, at_batch)

    def split_suggestion(self, target):
        """The largest size whose split_estimate stays within target, or None."""
        if self.max_batch_bytes <= 0:
            return None
        lo, hi = 1, 1
        while self.split_estimate(hi) <= target and hi < 1 << 30:
            lo, hi = hi, hi * 2
        if self.split_estimate(lo) > target:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.split_estimate(mid) <= target else (lo, mid)
        return lo


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A batch size that should fit, and how it was found."""

    batch_size: int
    fixed_bytes: int
    per_sample_bytes: float
    target_bytes: int
    method: str               # "line through measured steps", "split of one step", "trial steps"
    measured: bool = False    # confirmed by a trial step that fitted

    def predicted_peak(self, batch_size):
        return int(self.fixed_bytes + self.per_sample_bytes * batch_size)


def fit_line(points):
    """Fixed and per-sample bytes: the least-squares line through the steps that fitted.

    Peaks measured at one size vary from run to run (tf.data's threads decide which
    prepared batches are live at a step's peak: the test MLP read 37.6-39.5 MiB in five
    trials at 3,000 samples), so a line through two points follows their noise (a slope
    from two of those points once said 374 more samples cost 0.2 MiB); every point,
    repeats included, counts. On a concave curve the line is steeper than the curve at
    its top, so extrapolating it is on the safe side."""
    ok = [p for p in points if p.fits]
    if len({p.batch_size for p in ok}) < 2:
        return None
    mean_b = sum(p.batch_size for p in ok) / len(ok)
    mean_peak = sum(p.peak_bytes for p in ok) / len(ok)
    var = sum((p.batch_size - mean_b) ** 2 for p in ok)
    slope = sum((p.batch_size - mean_b) * (p.peak_bytes - mean_peak) for p in ok) / var
    if slope <= 0:
        return None
    return mean_peak - slope * mean_b, slope


def suggest(points, budget, headroom=0.1, max_batch=None, fixed_step_bytes=0):
    """The largest batch size whose predicted peak stays within (1 - headroom) of the budget.

    Args:
        points: measured steps (Point).
        budget: bytes.
        headroom: the fraction of the budget kept free for what the model does not see
            (fragmentation, an odd larger step). Defaults to 0.1.
        max_batch: an upper limit (the dataset's size), or None.
        fixed_step_bytes: bytes a step adds above its base whatever the batch (one
            gradient per trainable weight): with one measured size, growing is not
            charged for them. Defaults to 0.

    Returns:
        A Suggestion, or None when nothing was measured.
    """
    target = int(budget * (1.0 - headroom))
    fitted = [p for p in points if p.fits]
    if not fitted:
        return None
    line = fit_line(points)
    ref = max(fitted, key=lambda p: p.batch_size)
    if line is not None:
        fixed, slope = line
        method = "line through measured steps"
    else:
        # One size measured. Shrinking saves the bytes of batch-shaped tensors at the peak
        # (a lower bound of the local slope, so the estimate stays above the real peak);
        # growing costs at most what the step added above its base per sample, less what
        # it adds whatever the batch (the gradients: one per trainable weight).
        grown = max(ref.peak_bytes - ref.base_bytes - fixed_step_bytes, ref.batch_bytes, 1)
        above_base = grown / ref.batch_size
        shrink_slope = ref.batch_bytes / ref.batch_size if ref.batch_bytes > 0 else above_base
        slope = shrink_slope if ref.peak_bytes > target else above_base
        fixed = ref.peak_bytes - slope * ref.batch_size
        method = "split of one step"
    size = int((target - fixed) // slope) if slope > 0 else ref.batch_size
    # A failed step bounds the answer from above.
    for p in points:
        if not p.fits:
            size = min(size, p.batch_size - 1)
    if max_batch is not None:
        size = min(size, int(max_batch))
    return Suggestion(batch_size=max(size, 1), fixed_bytes=int(fixed), per_sample_bytes=float(slope),
                      target_bytes=target, method=method)


# ------------------------------------------------------------------------------------
# Trial steps


def _slice(data, n):
    import keras
    return keras.tree.map_structure(lambda a: a[:n], data) if data is not None else None


def _num_samples(x):
    import keras
    return min(len(a) for a in keras.tree.flatten(x))


class _Snapshot:
    """The model's weights and optimizer state, restored exactly after trial steps."""

    def __init__(self, model):
        self.model = model
        self.weights = [v.numpy().copy() for v in model.weights]
        opt = getattr(model, "optimizer", None)
        self.opt_built = bool(opt is not None and getattr(opt, "built", False))
        self.opt_values = [v.numpy().copy() for v in opt.variables] if self.opt_built else None

    def restore(self):
        for v, value in zip(self.model.weights, self.weights):
            v.assign(value)
        opt = getattr(self.model, "optimizer", None)
        if opt is None:
            return
        if self.opt_built:
            for v, value in zip(opt.variables, self.opt_values):
                v.assign(value)
        elif getattr(opt, "built", False):
            # Built by the trials: back to the state build() creates (zeros, step 0).
            for v in opt.variables:
                v.assign(v.numpy() * 0)


@contextlib.contextmanager
def _holding(pool, sizes):
    """Blocks of `sizes` kept allocated in the pool meanwhile; yields False when one was
    refused (the trial cannot fit then). Freed on the way out."""
    held, ok = [], True
    try:
        for size in sizes:
            if size > 0:
                held.append(pool.allocate(int(size)))
    except MemoryError:
        ok = False
    try:
        yield ok
    finally:
        for address in held:
            pool.free(address)


def trial_step(model, x, y, batch_size, pool, hold=()):
    """Runs one training step on the first `batch_size` samples and measures its peak.

    `hold`: sizes of blocks kept allocated in the pool during the step, standing for
    what a real fit() holds that a lone step does not (Keras' copy of a numpy dataset,
    tf.data's prefetched batches), so that the step meets the same budget and the same
    fragmentation. Returns a Point; fits=False when the pool refused a request (or a
    oneDNN kernel had to be granted over the budget). The caller restores the model.
    """
    oom_errors = _backend.oom_errors()
    gc.collect()
    before = pool.stats()
    with _holding(pool, hold) as fits:
        pool.reset_peak()
        if fits:
            _core.set_profile_batch(batch_size)
            try:
                model.train_on_batch(_slice(x, batch_size), _slice(y, batch_size))
            except oom_errors:
                fits = False
            finally:
                _core.set_profile_batch(0)
        after = pool.stats()
    if after["overshoots_by_kind"]["kernel"] > before["overshoots_by_kind"]["kernel"]:
        fits = False
    point = Point(batch_size=batch_size, peak_bytes=after["window_peak_bytes_in_use"],
                  batch_bytes=after["window_peak_batch_bytes"], base_bytes=before["bytes_in_use"],
                  fits=fits, max_batch_bytes=after["window_max_batch_bytes"],
                  in_use_at_max_batch=after["window_in_use_at_max_batch"])
    gc.collect()
    return point


def _pool_block_bytes(pool, tensor):
    """Bytes of the pool block that holds a CPU tensor's data (0 when it is not one)."""
    import numpy as np
    try:
        return pool.block_size(np.asarray(tensor).__array_interface__["data"][0])
    except (ValueError, _core.PoolError):
        return 0


class FitTrials:
    """Trial steps run the way fit() runs them on TensorFlow, for arrays x and y.

    A lone ``train_on_batch`` step needs less than a step of fit(), which feeds its steps
    from a tf.data pipeline: Keras' array adapter gathers each batch from one tensor
    copy of the arrays in a parallel map, and prefetches (both autotuned), so batches
    being prepared are live beside the step, more of them at its first steps. How much
    of that meets the step's peak differs by model and is timing (measured on the test
    MLP: fit() at 3,500 samples peaked about 4 MiB over a lone step; benchmarks/NOTES.md).
    So a trial here builds the same pipeline (a fresh one per trial, as fit() starts
    one per epoch) over a copy of the arrays made once, and runs a train function made
    for the trials (the model's own is left as it was) on it for a few steps; its peak
    is the largest step window.

    Inside a running fit() its own copy of the arrays is live already: the caller
    raises the budget by ``copy_bytes`` for the trials (see MemGuardCallback), and the
    points report peaks without the trials' copy. Call close() when done.
    """

    def __init__(self, model, x, y, pool, steps=2):
        import keras
        import tensorflow as tf

        self.model = model
        # A train function of its own, traced afresh: what a step needs depends on the
        # traces before it (TensorFlow relaxes shapes on retracing). The test MLP, trained
        # at 2,048 samples (a known batch size), then tried at 3,000 in the same
        # function, peaked 1.5 MiB under a new process's fit() at 3,000; in a function of
        # its own, whose first trace has an unknown batch size as fit()'s has, it matched.
        current = model.train_function
        try:
            model.train_function = None
            model.make_train_function(force=True)
            self.train_function = model.train_function
        finally:
            model.train_function = current
        self.pool = pool
        self.steps = steps
        self.n = _num_samples(x)
        parts = tuple(part for part in (x, y) if part is not None)
        self.tensors = keras.tree.map_structure(tf.convert_to_tensor, parts)
        # What of the copy is in the pool (TensorFlow takes small tensors from elsewhere);
        # counted block by block: the pool's total moves with fit()'s own threads.
        self.copy_bytes = sum(_pool_block_bytes(pool, t) for t in keras.tree.flatten(self.tensors))

    def _dataset(self, batch_size, steps):
        import tensorflow as tf

        n, b = self.n, min(batch_size, self.n)
        full = n // b
        # Not converted by AutoGraph (nothing to convert): it caches a conversion per code
        # object, and these closures, made again for every size, once made it fail with
        # "closure mismatch" in a test run.
        plain = tf.autograph.experimental.do_not_convert

        @plain
        def permutation(_):
            return tf.random.shuffle(tf.range(n, dtype=tf.int64))

        @plain
        def batches(indices):
            # With the last, partial batch as fit() has it: the batch dimension of the
            # dataset's elements is then unknown, and the step TensorFlow traces for that
            # can need more than one for a known size (the README's CNN: 5 MiB more at 240).
            # Always so: with no partial batch the remainder is empty and never reached.
            out = tf.data.Dataset.from_tensor_slices(tf.reshape(indices[:full * b], [full, b]))
            return out.concatenate(tf.data.Dataset.from_tensors(indices[full * b:]))

        @plain
        def grab(indices, data):
            return tf.nest.map_structure(lambda t: tf.gather(t, indices, axis=0), data)

        # As keras/src/trainers/data_adapters/array_data_adapter.py (Keras 3) builds it.
        index = tf.data.Dataset.range(1).map(permutation).prefetch(1).flat_map(batches)
        data = tf.data.Dataset.zip((index, tf.data.Dataset.from_tensors(self.tensors).repeat()))
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = False
        data = data.map(grab, num_parallel_calls=tf.data.AUTOTUNE).with_options(options)
        return data.prefetch(tf.data.AUTOTUNE), min(steps, full)

    def __call__(self, batch_size, hold=(), steps=None, rounds=1, profile=False):
        """A Point for `batch_size`, from `rounds` fresh pipelines of `steps` steps each
        (default: the constructor's), with blocks of the sizes in `hold` kept in the pool
        meanwhile. Its peak is the largest of the steps' windows, less the trials' copy;
        fits=False when the pool refused a request (or a oneDNN kernel had to be granted
        over the budget). With `profile`, the batch-shaped bytes of the window that
        peaked are measured too (Point.split_estimate). The caller restores the model."""
        oom_errors = _backend.oom_errors()
        pool = self.pool
        gc.collect()
        before = pool.stats()
        top = None  # the stats of the window that peaked highest
        with _holding(pool, hold) as fits:
            for _ in range(rounds if fits else 0):
                dataset, count = self._dataset(batch_size, steps or self.steps)
                pool.reset_peak()
                iterator = iter(dataset)
                if profile:
                    _core.set_profile_batch(batch_size)
                try:
                    for _ in range(count):
                        self.train_function(iterator)
                        top = _higher(top, pool.stats())
                        pool.reset_peak()
                except oom_errors:
                    fits = False
                finally:
                    _core.set_profile_batch(0)
                    top = _higher(top, pool.stats())
                    del iterator, dataset
                if not fits:
                    break
            after = pool.stats()
        if after["overshoots_by_kind"]["kernel"] > before["overshoots_by_kind"]["kernel"]:
            fits = False
        gc.collect()
        copy = self.copy_bytes
        peak = top["window_peak_bytes_in_use"] if top else 0
        point = Point(batch_size=batch_size, peak_bytes=max(peak - copy, 0), base_bytes=before["bytes_in_use"] - copy,
                      fits=fits)
        if profile and top:
            point = dataclasses.replace(
                point, batch_bytes=top["window_peak_batch_bytes"], max_batch_bytes=top["window_max_batch_bytes"],
                in_use_at_max_batch=max(top["window_in_use_at_max_batch"] - copy, 0))
        return point

    def close(self):
        self.tensors = self.train_function = None
        gc.collect()


def _higher(top, stats):
    """Of two pool stats, the one whose window peaked higher (`top` may be None)."""
    return stats if top is None or stats["window_peak_bytes_in_use"] > top["window_peak_bytes_in_use"] else top


def peak_spread(points, budget):
    """The largest difference between peaks measured at one batch size; a size that
    fitted once and was refused once counts its fitted peak's distance to the budget."""
    spread = 0
    sizes = {p.batch_size for p in points}
    for size in sizes:
        at = [p for p in points if p.batch_size == size]
        fitted = [p.peak_bytes for p in at if p.fits]
        if len(fitted) >= 2:
            spread = max(spread, max(fitted) - min(fitted))
        if fitted and len(fitted) < len(at):
            spread = max(spread, budget - min(fitted))
    return spread


def _next_trial(points, budget, n, start, headroom, max_growth=None):
    """The batch size to try next, or None when the answer is known closely enough;
    with `max_growth`, at most that many times the largest size that fitted."""
    fitted = sorted((p for p in points if p.fits), key=lambda p: p.batch_size)
    failed = sorted((p for p in points if not p.fits), key=lambda p: p.batch_size)
    best = fitted[-1] if fitted else None
    ceiling = failed[0] if failed else None
    target = budget * (1.0 - headroom)
    if best is None:
        return max(1, ceiling.batch_size // 4) if ceiling else min(n, start or 32)
    if ceiling is None:
        if best.batch_size >= n:
            return None
        if len({p.batch_size for p in fitted}) == 1:
            # Between a pessimistic estimate (everything the step added scales with the
            # batch) and an optimistic one (only batch-shaped tensors do): their geometric
            # mean. Without batch-shaped tensors tagged (PyTorch), the pessimistic one:
            # curves are concave, so it lands below the limit and the next line is closer.
            low = suggest([best], budget, headroom).batch_size
            high = best.split_suggestion(target) or low
            size = min(int((max(low, 1) * max(high, low, 1)) ** 0.5), 32 * best.batch_size)
        else:
            size = suggest(fitted, budget, headroom).batch_size
        if max_growth:
            size = min(size, int(max_growth * best.batch_size))  # a line through noisy peaks can run far
        size = min(size, n)
        return size if size > best.batch_size else min(n, best.batch_size + max(1, best.batch_size // 8))
    gap = ceiling.batch_size - best.batch_size
    if gap <= max(1, best.batch_size // 50):
        return None
    # The middle of the bracket: a line from the largest fitting step to the smallest
    # refused one (whose need is only known to be over the budget) is no guide where the
    # curve bends (the test MLP's trial peaks barely grow from 2,048 to 2,500 samples,
    # then steeply: such a line went to the top of the bracket three times).
    return best.batch_size + gap // 2


def search(model, x, y, budget, pool, points=(), trials=4, start=None, hold=None, headroom=0.03, run=None,
           max_growth=None):
    """Largest batch size whose trial step fits the budget, with at most `trials` steps.

    `hold(batch_size)` gives the blocks to keep allocated during a trial (see
    trial_step). `run(batch_size, hold)` runs a trial instead of trial_step (FitTrials).
    `max_growth`: no trial above that many times the largest size that fitted (for a
    search that starts near the limit, where a line through noisy peaks can run far;
    not for one that starts small and must get there in a few steps).
    Returns (Suggestion, points); the Suggestion's batch size is the largest that fitted
    in a trial (or the best estimate, measured=False, if none did).
    """
    n = _num_samples(x)
    points = list(points)
    snapshot = _Snapshot(model)
    try:
        for _ in range(trials):
            size = _next_trial(points, budget, n, start, headroom, max_growth)
            if size is None or any(p.batch_size == size for p in points):
                break
            held = hold(size) if hold else ()
            points.append(run(size, held) if run else trial_step(model, x, y, size, pool, hold=held))
            snapshot.restore()
    finally:
        snapshot.restore()
        if hasattr(model, "reset_metrics"):
            model.reset_metrics()
    best = max((p.batch_size for p in points if p.fits), default=0)
    line = suggest(points, budget, headroom=headroom, max_batch=n)
    return Suggestion(batch_size=best if best else (line.batch_size if line else 1),
                      fixed_bytes=line.fixed_bytes if line else 0,
                      per_sample_bytes=line.per_sample_bytes if line else 0.0,
                      target_bytes=budget, method="trial steps", measured=best > 0), points


def _arrays(x, y=None):
    """The arrays of x and y (structures of arrays, as for fit())."""
    import keras
    return [a for part in (x, y) if part is not None for a in keras.tree.flatten(part)
            if hasattr(a, "nbytes") and hasattr(a, "shape") and len(a.shape) > 0]


def input_bytes_per_sample(x, y=None):
    """Bytes of one sample of the arrays x and y (a batch's worth is b times this)."""
    return sum(int(a.nbytes) // max(int(a.shape[0]), 1) for a in _arrays(x, y))


def state_bytes(model):
    """Bytes of a model's variables and its optimizer's."""
    import numpy as np
    opt = getattr(model, "optimizer", None)
    variables = list(model.weights) + (list(opt.variables) if opt is not None and getattr(opt, "built", False) else [])
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def copy_bytes(x, y=None):
    """Bytes of one copy of the arrays x and y as tensors (each rounded up to 4 KiB)."""
    return sum(-(-int(a.nbytes) // 4096) * 4096 for a in _arrays(x, y))


def fit_holds(x, y=None, prefetched=2, framework="tensorflow", copies=True):
    """What fit() keeps in the pool beside a step, for arrays x and y.

    TensorFlow: a copy of every array (Keras turns them into one tensor each), and a few
    batches prepared ahead by tf.data (fit() peaks measured 1-4 batches above a lone
    step plus the copy on TF 2.21). PyTorch: the arrays stay in host memory and each
    batch is moved to the GPU in its step, so only the batch being moved. Returns
    hold(batch_size): one block, the copy being one long-lived tensor that the step's
    tensors are placed around. `copies=False` leaves the copy out (when the pool holds
    one already, as inside fit())."""
    per_sample = input_bytes_per_sample(x, y)
    if framework == "torch":
        return lambda batch_size: [per_sample * batch_size]
    copy = sum(int(a.nbytes) for a in _arrays(x, y)) if copies else 0
    return lambda batch_size: [copy + per_sample * batch_size * prefetched]


def find_batch_size(model, x, y=None, max_bytes=None, device=None, trials=4, start=None, margin=0.05):
    """The largest batch size whose training step fits the budget, in at most `trials` steps.

    Each trial is one real training step under the budget; a refused step counts as
    too big. On TensorFlow it is the first step of a tf.data pipeline built as fit()
    builds it over a copy of the arrays (see FitTrials); on PyTorch, a
    ``train_on_batch`` step on the first samples of `x` beside a block the size of the
    batch fit() moves to the device. The trials start small
    (or at `start`) and move by a line fitted through the measured peaks, which for the
    concave memory curves of real models approaches the largest size from below.
    The model's weights and optimizer state are restored exactly afterwards; its metrics
    are reset.

    Args:
        model: a compiled Keras model.
        x: the training inputs (arrays, or a structure of arrays, as for fit()).
        y: the targets. Defaults to None.
        max_bytes: the budget to fit, as for install(). Defaults to the installed one.
        device: Defaults to the device install() was called for (else "CPU:0" on
            TensorFlow, "GPU:0" on Keras' torch backend).
        trials: the most training steps to run. Defaults to 4.
        start: the first batch size tried. Defaults to 32 (or fewer samples).
        margin: the fraction taken off the largest size that fitted in a trial: a lone
            step meets the budget in one layout of the pool, a run goes through many.
            Defaults to 0.05.

    Returns:
        The batch size (an int). It fits when fit() is called with the same data under the
        same budget, with the pool's fragmentation allowed for.

    Raises:
        ValueError: the model is not compiled, there is no budget, or x is empty.

    Example:
        >>> tf_memguard.install(max_bytes="1GiB")
        >>> size = tf_memguard.find_batch_size(model, x_train, y_train)
        >>> model.fit(x_train, y_train, batch_size=size)
    """
    from tf_memguard import _install
    from tf_memguard._units import parse_bytes

    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", True):
        raise ValueError("find_batch_size(model=...): compile the model first (model.compile(...))")
    if _num_samples(x) < 1:
        raise ValueError("find_batch_size(x=...): x holds no samples")
    device = _install.resolve_device(device)
    pool = _install.device_pool(device)
    installed = _install.config(device)
    if max_bytes is None and installed is None:
        raise ValueError("find_batch_size(max_bytes=None): no budget to fit; pass max_bytes or call "
                         "tf_memguard.install() first")
    if not isinstance(trials, int) or trials < 1:
        raise ValueError(f"find_batch_size(trials={trials!r}): must be an int of at least 1")
    if not (0 <= margin < 1):
        raise ValueError(f"find_batch_size(margin={margin!r}): must be a fraction in [0, 1)")
    budget = installed.max_bytes if max_bytes is None else parse_bytes(max_bytes, pool.total_memory())
    if installed is None:
        _install.install(budget, device)
    previous = pool.stats()["bytes_limit"]
    if budget != previous:
        pool.release_unused()
        pool.set_limit(budget)
    fit_trials = None
    try:
        if _backend.framework() == "tensorflow":
            # A step as fit() runs it (see FitTrials): a lone train_on_batch step needs
            # less, and its answer once ran out (the example's CNN at 128 MiB: a lone
            # step fitted at 497, and 472 ran out in fit(), where 400 trains). The
            # trials' copy of the arrays stands for fit()'s; their peaks leave it out.
            fit_trials = FitTrials(model, x, y, pool, steps=1)
            found, _ = search(model, x, y, budget - fit_trials.copy_bytes, pool, trials=trials, start=start,
                              run=lambda size, hold: fit_trials(size, hold, profile=True))
        else:
            found, _ = search(model, x, y, budget, pool, trials=trials, start=start,
                              hold=fit_holds(x, y, framework=_backend.framework()))
    finally:
        if fit_trials is not None:
            fit_trials.close()
        if budget != previous and previous:
            pool.release_unused()
            pool.set_limit(previous)
    if not found.measured:
        from tf_memguard._units import format_bytes
        raise _core.OutOfBudgetError(
            f"find_batch_size: not even a batch of {found.batch_size} fits the "
            f"{format_bytes(budget)} budget with this data; pass a larger max_bytes")
    return max(1, int(found.batch_size * (1 - margin)))
