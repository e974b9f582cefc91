"""MemGuardCallback: per-epoch peaks in the Keras logs, warnings with a batch size that
fits, the memory report, and out-of-memory errors that explain themselves."""
import gc
import inspect
import math
import time
import traceback
import warnings

import keras

from tf_memguard import _advisor, _backend, _core, _install, _report
from tf_memguard._units import format_bytes


# The share of the largest batch size that fitted a trial step (or of the estimate) that
# is suggested after an out-of-memory error: the retry must fit, first time.
OOM_SAFETY = 0.75
# The share taken off the size where the line through the trials' peaks reaches the
# budget: the line is fitted to a few noisy points and extrapolated a little. With the
# trials run as fit() runs its steps, the README's example gets 216-226 suggested (its
# limit: 230 trains, 235 and 240 ran out in three runs of five).
ADVICE_MARGIN = 0.05
# The same where each trial kept the highest peak of NOISY_ROUNDS pipelines: its points
# are the top of what a size needs, and the search ends within a few percent of where
# they reach the budget (the test MLP: 2,780-2,890 suggested, where two-epoch runs train
# at 2,950 and 3,000 ran out in three runs of five; with 5% off, 2,680-2,820).
ADVICE_MARGIN_NOISY = 0.03
# Where measured advice aims its trials: 99% of the budget (they measure, and fit).
MEASURED_HEADROOM = 0.01
# The most a trial of the measured advice grows the largest size that fitted (the test
# MLP's peaks barely grow from 2,048 to 2,500 samples, then steeply: a line through the
# first ones runs far past the limit).
MAX_TRIAL_GROWTH = 1.5
# How far past the largest size whose trial fitted the measured line may be followed.
MAX_EXTRAPOLATION = 0.10
# How many times the spread of the peaks measured at one size the advice keeps below the
# budget, besides ADVICE_MARGIN (the test MLP: 0.5-2 MiB between two trials at one size,
# 1-5% of its budget; the CNNs and the LSTM: under 0.3 MiB).
NOISE_SPREADS = 0.5
# Trials at the running size, first.
B0_TRIALS = 3
# Trials at the running size that differ by more than this share of the budget mark
# a model whose peaks vary from pipeline to pipeline; its trials then take NOISY_ROUNDS
# pipelines each and keep the highest peak.
NOISY_SPREAD = 0.01
NOISY_ROUNDS = 3
# Steps of the trial that repeats the largest size that fitted (other trials run
# FitTrials' default of 2: a pipeline's first steps peak highest).
CONFIRM_STEPS = 4
# A one-step estimate that grows the running batch size by less than this share is not
# suggested (the running size, measured to fit, is): so close to the limit, where the
# pool's layout decides, the estimate is not that precise (the CNN of test_advice at 80
# MiB peaked at 88% of the budget at batch 76; 78 was suggested and ran out).
MIN_GROWTH = 0.10


_budget_exceeded = {}


def _budget_exceeded_error():
    """BudgetExceededError, made on first use as a subclass of the backend's out-of-memory
    error (so that importing the callback does not import TensorFlow on torch)."""
    framework = _backend.framework()
    if framework not in _budget_exceeded:
        base = _backend.oom_errors()[0]

        def __init__(self, message):
            if framework == "torch":
                base.__init__(self, message)
            else:
                base.__init__(self, None, None, message)

        _budget_exceeded[framework] = type("BudgetExceededError", (base,), {
            "__init__": __init__, "__module__": "tf_memguard",
            "__doc__": """A step went over the budget without the framework raising: on TensorFlow a
    oneDNN kernel's request had to be granted (oneDNN kernels crash on a refusal), so
    MemGuardCallback stops the run after that step. A subclass of the backend's
    out-of-memory error (tf.errors.ResourceExhaustedError, torch.OutOfMemoryError), so
    its handlers catch it too."""})
    return _budget_exceeded[framework]


def __getattr__(name):
    if name == "BudgetExceededError":
        return _budget_exceeded_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fit_arguments():
    """The arguments of the Keras fit() call running now (its frame's locals), or {}.

    Keras does not hand callbacks the batch size or the data; fit()'s own frame has them.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            code = frame.f_code
            if code.co_name == "fit" and "keras" in code.co_filename.replace("\\", "/"):
                return dict(frame.f_locals)
            frame = frame.f_back
        return {}
    finally:
        del frame


def _is_arrays(data):
    if data is None:
        return False
    leaves = keras.tree.flatten(data)
    return bool(leaves) and all(hasattr(a, "shape") and hasattr(a, "nbytes") and not keras.ops.is_tensor(a)
                                and len(a.shape) > 0 for a in leaves)


def _largest_free(refusal):
    """The largest free block at a refusal, as its message names it. Where the pool backs
    its regions on demand (host and CUDA), they are address space, twice the budget: a
    free block can be larger than the budget, and what of it the budget can back is the
    figure that decides."""
    largest, allocatable = refusal["largest_free_block_bytes"], refusal["largest_allocatable_bytes"]
    if allocatable < largest:
        return f"{format_bytes(allocatable)} within the budget"
    return format_bytes(largest)


def _gradient_bytes(model):
    """Bytes of one gradient per trainable weight: what a training step holds at once
    whatever its batch size."""
    import numpy as np
    try:
        return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_weights)
    except (AttributeError, TypeError):
        return 0


class MemGuardCallback(keras.callbacks.Callback):
    """Records the memory of every epoch, warns near the budget, and explains an OOM.

    At the start of each epoch the pool's window peak is reset; at its end the epoch's
    peak goes into the Keras logs as ``memguard_peak_bytes``, and with a budget installed
    ``memguard_budget_fraction`` (peak / budget), so History, CSVLogger and TensorBoard
    record them. When Keras is verbose, one line per epoch is printed
    ("epoch 3: peak 5.2 GiB of 6.0 GiB (87%)"). When a peak reaches ``warn_at`` of the
    budget, a warning says which batch size fits with ``headroom``. At the end of
    training a memory report is printed (unless silent) and kept for
    ``tf_memguard.report()``.

    The batch size is taken from the argument if given, else from the running fit()
    call's ``batch_size`` for array data (Keras' default of 32 when it is None), else
    from a ``tf.data`` dataset's static batch dimension; without it there is no advice.
    The first ``profile_steps`` steps of each epoch are profiled: the plugin marks
    tensors whose first dimension is the batch size, splitting the step's peak into
    fixed and per-sample bytes.

    When a step does not fit the budget, the backend's out-of-memory error
    (TensorFlow's ResourceExhaustedError, torch.OutOfMemoryError) gets a note
    with tf_memguard's explanation (request, budget, in use, largest free block) and a
    batch size that fits, measured with up to ``oom_trials`` trial steps when fit() was
    given arrays (weights and optimizer state restored), else estimated on the safe side;
    the report of the epochs so far is produced; the model stays usable. Call
    ``gc.collect()`` before retrying: the failed fit()'s prefetched batches stay in the
    pool until the exception is collected.

    A leak is flagged when the bytes live at the end of an epoch grew in each of the last
    ``leak_epochs`` epochs by more than 1 MiB and 1% of the peak.

    Args:
        device: the pool to watch. Defaults to the device install() was called for
            (else "CPU:0" on TensorFlow, "GPU:0" on Keras' torch backend).
        warn_at: fraction of the budget at which an epoch's peak draws a warning.
            Defaults to 0.9.
        headroom: fraction of the budget a suggested batch size leaves free, for the
            pool's fragmentation and what the model of the step misses. Defaults to
            0.15 (TensorFlow runs that ran out by layout did so with up to 12% of the
            budget free: see benchmarks/NOTES.md).
        batch_size: the training batch size, if it cannot be learned from fit().
            Defaults to None.
        verbose: 0 silences the per-epoch lines and the report; "auto" follows fit()'s
            verbose. Defaults to "auto".
        leak_epochs: consecutive epochs of growth that flag a leak. Defaults to 3.
        profile_steps: steps profiled at the start of each epoch. Defaults to 2.
        oom_trials: trial steps that measure the advice after an out-of-memory error
            (0: estimate only). Defaults to 3.
        advice_trials: trials run once, after the first epoch of a run whose peak
            reached half of its budget, to measure the advice (array data only; weights
            and optimizer state restored; the pool's unused memory is released after
            them). On TensorFlow a trial is two training steps fed as fit() feeds them
            (a tf.data pipeline over a copy of the arrays, for which the budget is
            raised meanwhile; three such pipelines, keeping the highest peak, for a
            model whose peaks vary); on PyTorch one step. Three at the running batch size,
            up to ``advice_trials - 4`` heading for 99% of the budget, one more at the
            largest size that fitted; the advice is where the least-squares line
            through their peaks reaches the budget, minus 5% (3% for the varying kind).
            If they cannot be run, a warning says why and the estimate stands. 0: the
            one-step estimate, which leaves ``headroom`` free. Defaults to 8.

    Example:
        >>> tf_memguard.install(max_bytes="2GiB")
        >>> model.fit(x, y, batch_size=256, callbacks=[tf_memguard.MemGuardCallback()])
        >>> print(tf_memguard.report())
    """

    def __init__(self, device=None, warn_at=0.9, headroom=0.15, batch_size=None, verbose="auto",
                 leak_epochs=3, profile_steps=2, oom_trials=3, advice_trials=8):
        super().__init__()
        self.device = _install.normalize_device(device) if device is not None else None
        if not (isinstance(warn_at, (int, float)) and 0 < warn_at <= 1):
            raise ValueError(f"warn_at={warn_at!r}: must be a fraction in (0, 1]")
        if not (isinstance(headroom, (int, float)) and 0 <= headroom < 1):
            raise ValueError(f"headroom={headroom!r}: must be a fraction in [0, 1)")
        if batch_size is not None and not (isinstance(batch_size, int) and batch_size > 0):
            raise ValueError(f"batch_size={batch_size!r}: must be a positive int or None")
        if verbose not in ("auto", 0, 1, 2, True, False):
            raise ValueError(f"verbose={verbose!r}: must be 'auto', 0, 1 or 2")
        for name, value in (("leak_epochs", leak_epochs), ("profile_steps", profile_steps),
                            ("oom_trials", oom_trials), ("advice_trials", advice_trials)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be a non-negative int")
        self.warn_at = float(warn_at)
        self.headroom = float(headroom)
        self.batch_size = batch_size
        self.verbose = verbose
        self.leak_epochs = leak_epochs
        self.profile_steps = profile_steps
        self.oom_trials = oom_trials
        self.advice_trials = advice_trials

    # -- per-run state -------------------------------------------------------------

    def on_train_begin(self, logs=None):
        # Everything per run is reset here, so one instance serves several fit() calls.
        self._device = _install.resolve_device(self.device)
        self._oom_types = _backend.oom_errors()
        self._pool = _install.device_pool(self._device)
        self._start = self._pool.stats()
        self._budget = self._start["bytes_limit"]
        fit_args = _fit_arguments()
        self._fit_x, self._fit_y = fit_args.get("x"), fit_args.get("y")
        self._fit_validation = fit_args.get("validation_data")
        self._run_batch = self.batch_size or self._learn_batch_size(fit_args)
        self._points = []
        self._records = []
        self._steps = []
        self._live_at_end = []
        self._global_step = 0
        self._epoch = 0
        self._epoch_peak = 0
        self._epoch_start = None
        self._profiling = False
        self._warned = False
        self._oom = None
        self._suggestion = None
        self._measured = None  # the suggestion measured by trial steps (False: tried, none)
        self._trial_counts = (0, 0)  # allocations and refusals of the advice's trials
        self._report = None
        self._in_trials = False
        self._kernel_overshoots = self._start["overshoots_by_kind"]["kernel"]
        self._wrap_train_function()

    def _learn_batch_size(self, fit_args):
        x = fit_args.get("x")
        if _is_arrays(x):
            return fit_args.get("batch_size") or 32
        spec = getattr(x, "element_spec", None)
        if spec is not None:
            leaves = keras.tree.flatten(spec)
            dims = {leaf.shape[0] for leaf in leaves if getattr(leaf, "shape", None) is not None
                    and len(leaf.shape) > 0 and leaf.shape[0] is not None}
            if len(dims) == 1:
                return int(dims.pop())
        return None

    def _talks(self):
        if self.verbose == "auto":
            return bool(self.params.get("verbose", 1)) if self.params else True
        return bool(self.verbose)

    # -- epochs and steps ------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = self._pool.stats()
        self._epoch_time = time.perf_counter()
        self._epoch_peak = 0
        self._pool.reset_peak()

    def on_train_batch_begin(self, batch, logs=None):
        # Each step gets its own window; the epoch's peak is the largest of them.
        self._epoch_peak = max(self._epoch_peak, self._pool.stats()["window_peak_bytes_in_use"])
        self._pool.reset_peak()
        self._step_base = self._pool.stats()["bytes_in_use"]
        self._profiling = bool(self._run_batch) and batch < self.profile_steps
        if self._profiling:
            _core.set_profile_batch(self._run_batch)

    def on_train_batch_end(self, batch, logs=None):
        s = self._pool.stats()
        if self._profiling:
            _core.set_profile_batch(0)
            self._profiling = False
            self._points.append(_advisor.Point(
                batch_size=self._run_batch, peak_bytes=s["window_peak_bytes_in_use"],
                batch_bytes=s["window_peak_batch_bytes"], base_bytes=self._step_base,
                max_batch_bytes=s["window_max_batch_bytes"], in_use_at_max_batch=s["window_in_use_at_max_batch"]))
        step_peak = s["window_peak_bytes_in_use"]
        self._epoch_peak = max(self._epoch_peak, step_peak)
        self._steps.append((self._global_step, step_peak, s["bytes_in_use"], self._epoch))
        self._global_step += 1
        self._pool.reset_peak()
        kernel = s["overshoots_by_kind"]["kernel"]
        if kernel > self._kernel_overshoots:
            self._kernel_overshoots = kernel
            self._stop_for_overshoot(s)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        s = self._pool.stats()
        peak = max(self._epoch_peak, s["window_peak_bytes_in_use"])
        self._pool.reset_peak()
        budget = self._budget
        record = _report.EpochRecord(
            epoch=epoch + 1, peak_bytes=peak, budget_fraction=peak / budget if budget else math.nan,
            allocs=s["num_allocs"] - self._epoch_start["num_allocs"],
            refusals=s["num_refusals"] - self._epoch_start["num_refusals"],
            fragmentation=s["fragmentation"], live_bytes=s["bytes_in_use"],
            seconds=time.perf_counter() - self._epoch_time)
        self._records.append(record)
        self._live_at_end.append(s["bytes_in_use"])
        logs["memguard_peak_bytes"] = float(peak)
        if budget:
            logs["memguard_budget_fraction"] = float(peak / budget)
        if self._talks():
            if budget:
                print(f"epoch {epoch + 1}: peak {format_bytes(peak)} of {format_bytes(budget)} "
                      f"({100 * peak / budget:.0f}%)")
            else:
                print(f"epoch {epoch + 1}: peak {format_bytes(peak)} (no budget installed)")
        if budget and self._measured is None and self._points and self.advice_trials and peak >= budget / 2:
            # Once per run, after its first epoch, when the run uses half of its budget or
            # more: a few trial steps measure the advice. What they took goes back.
            self._suggest(measure=True)
            self._measured = self._measured or False
            self._pool.release_unused()
        if budget and peak >= self.warn_at * budget and not self._warned:
            self._warned = True
            suggestion = self._suggest()
            if suggestion is None:
                advice = " Pass batch_size= to MemGuardCallback for a suggestion."
            elif suggestion.measured:
                advice = (f" A batch size of about {suggestion.batch_size} (now {self._run_batch}) fits it, "
                          "measured by trial steps.")
            else:
                advice = (f" A batch size of about {suggestion.batch_size} (now {self._run_batch}) would leave "
                          f"{100 * self.headroom:.0f}% of it free.")
            warnings.warn(f"tf_memguard: epoch {epoch + 1} peaked at {format_bytes(peak)}, "
                          f"{100 * peak / budget:.0f}% of the {format_bytes(budget)} budget on {self._device}."
                          + advice, stacklevel=2)

    def on_train_end(self, logs=None):
        self._unwrap_train_function()
        self._finish()

    # -- advice ----------------------------------------------------------------------

    def _suggest(self, measure=False):
        """The batch size that fits the budget with headroom, from the steps measured
        (and with `measure`, up to ``advice_trials`` trial steps)."""
        if not self._budget or not self._points or not self._run_batch:
            return None
        if self._measured:
            self._suggestion = self._measured
            return self._suggestion
        target = self._budget * (1.0 - self.headroom)
        ref = max(self._points, key=lambda p: p.peak_bytes)
        # Raise the reference peak to the worst epoch peak seen: a step outside the
        # profiled ones may have needed more.
        worst = max([r.peak_bytes for r in self._records] + [ref.peak_bytes])
        ref = _advisor.Point(**{**ref.__dict__, "peak_bytes": worst})
        # Two one-step estimates: "everything the step added above its base scales with
        # the batch, but for one gradient per trainable weight" (over-estimates the cost
        # of growing) and "only the batch-shaped tensors do" (over-estimates the saving of
        # shrinking is avoided: it counts only those). The smaller answer is on the safe
        # side both ways.
        line = _advisor.suggest([ref], self._budget, headroom=self.headroom,
                                fixed_step_bytes=_gradient_bytes(self.model))
        split = ref.split_suggestion(target)
        size = min(line.batch_size, split) if split else line.batch_size
        if self._run_batch < size < self._run_batch * (1 + MIN_GROWTH):
            size = self._run_batch
        n = self._num_samples()
        if n:
            size = min(size, n)
        self._suggestion = _advisor.Suggestion(
            batch_size=max(1, size), fixed_bytes=line.fixed_bytes, per_sample_bytes=line.per_sample_bytes,
            target_bytes=int(target), method="the steps profiled in this run")
        if measure:
            try:
                measured = self._measure_suggestion()
            except Exception as e:  # noqa: BLE001 - advice must never stop the training it advises
                warnings.warn(f"tf_memguard: the batch-size advice could not be measured ({type(e).__name__}: {e}); "
                              "the estimate from the profiled steps stands.", stacklevel=2)
                measured = None
            if measured is not None:
                self._suggestion = self._measured = measured
        return self._suggestion

    def _measure_suggestion(self):
        """Trials beside the running fit(), from the running batch size b0 towards where
        peak memory reaches the budget; the model's weights and optimizer state are
        restored. The answer is where the least-squares line through the measured peaks,
        less half the largest spread seen at one size (NOISE_SPREADS), reaches the budget
        (not past a size that was refused, nor more than MAX_EXTRAPOLATION past the
        largest that fitted), minus ADVICE_MARGIN (ADVICE_MARGIN_NOISY); the running size
        when that grows it by less than MIN_GROWTH. None without array data or trials,
        or when a trial at b0 is refused.

        On TensorFlow a trial runs a train function of its own on a tf.data pipeline
        built as fit() builds it (FitTrials): a lone train_on_batch step misses the
        batches fit() prepares beside its steps, and runs the step TensorFlow traced for a
        known batch size, where fit()'s batches have none (the README's CNN needs 5 MiB
        more for that one). What a process that copied every array would hold beyond
        this one is held in the pool during the trials. Three trials at b0, then up to
        ``advice_trials - 4`` heading for (1 - MEASURED_HEADROOM) of the budget, then the
        largest size that fitted once more, for CONFIRM_STEPS steps; where those at b0
        differ by more than NOISY_SPREAD, every later trial keeps the highest of
        NOISY_ROUNDS pipelines (benchmarks/NOTES.md, "Batch-size advice"). If the epoch's
        own peak exceeded the smallest trial at b0 (on PyTorch, fit() holds the batch it
        moves to the device beside the step), the difference is held during every trial.
        """
        if not self.advice_trials or not _is_arrays(self._fit_x):
            return None
        b0 = self._run_batch
        fit_peak = max(r.peak_bytes for r in self._records)
        model, x, y = self.model, self._fit_x, self._fit_y
        pool, budget = self._pool, self._budget
        self._in_trials = True
        start = pool.stats()
        snapshot = _advisor._Snapshot(model)
        fit_trials = None
        raised = False
        missing = 0
        try:
            if _backend.framework() == "tensorflow":
                # fit() holds the model's state and a copy of the arrays (training and
                # validation parts) as tensors. Whether TensorFlow copied an array into the
                # pool or aliased it differs from process to process (the README's example:
                # its validation part was in the pool in two runs of three), so what a
                # process without the copies lacks is held during the trials: the advice
                # must hold in the next process too.
                gc.collect()
                expected = (_advisor.state_bytes(model) + _advisor.copy_bytes(x, y)
                            + _advisor.copy_bytes(self._fit_validation))
                missing = max(0, expected - pool.stats()["bytes_in_use"])
                # The trials' copy of the arrays comes on top of fit()'s own: the budget is
                # raised for it first, then to what of it is in the pool (TensorFlow
                # aliases some arrays instead of copying them).
                pool.set_limit(budget + _advisor.copy_bytes(x, y))
                raised = True
                fit_trials = _advisor.FitTrials(model, x, y, pool)
                pool.set_limit(budget + fit_trials.copy_bytes, drain=True)

            rounds = 1  # pipelines per trial (see NOISY_SPREAD below)

            def trial(size, hold=(), steps=None):
                # One way to run a trial, for the three at b0, the search and the last.
                if fit_trials is not None:
                    p = fit_trials(size, hold, steps=steps, rounds=rounds)
                else:
                    p = _advisor.trial_step(model, x, y, size, pool, hold=hold)
                snapshot.restore()
                return p

            # Three at b0: what fit() leaves live at an epoch's end varies, and whether
            # the model's peaks vary from pipeline to pipeline shows here (two draws of
            # the test MLP agreed once in six runs; its suggestion then came from single
            # draws, and once ran out).
            at_b0 = [trial(b0, [missing]) for _ in range(B0_TRIALS)]
            if not all(p.fits for p in at_b0):
                return None
            # What the epoch's own peak at b0 showed beyond the trials (with what a
            # process with every copy would hold).
            over = max(0, fit_peak + missing - min(p.peak_bytes for p in at_b0))
            per_sample = _advisor.input_bytes_per_sample(x, y)

            def hold(size):
                if fit_trials is not None:
                    return [int(missing + over)]
                # A lone step: at least one batch of input, which fit() may have prepared
                # beside its step (whether it was live at b0's peak is timing).
                return [int(max(over, per_sample * size))]

            known = [_advisor.Point(**{**p.__dict__, "peak_bytes": p.peak_bytes + over}) for p in at_b0]
            # Where the trials at b0 differ by more than NOISY_SPREAD of the budget,
            # which of fit()'s prepared batches meet a step's peak is timing: every trial
            # then takes NOISY_ROUNDS fresh pipelines and keeps the highest peak (the test
            # MLP at 3,000 samples read 38.0 or 38.9 MiB, the higher in 8 of 12), and b0's
            # point is the highest of its three.
            b0_peaks = [p.peak_bytes for p in at_b0]
            if fit_trials is not None and max(b0_peaks) - min(b0_peaks) > NOISY_SPREAD * budget:
                rounds = NOISY_ROUNDS
                known = [max(known, key=lambda p: p.peak_bytes)]
            _, points = _advisor.search(model, x, y, budget, pool, points=known,
                                        trials=max(self.advice_trials - B0_TRIALS - 1, 1), start=b0,
                                        headroom=MEASURED_HEADROOM, hold=hold, run=trial,
                                        max_growth=MAX_TRIAL_GROWTH)
            grown = [p for p in points if p.fits and p.batch_size > b0]
            if grown and self.advice_trials > B0_TRIALS + 1:
                top = max(p.batch_size for p in grown)
                points.append(trial(top, hold(top), steps=CONFIRM_STEPS))
        except self._oom_types:
            return None
        finally:
            snapshot.restore()
            self._in_trials = False
            if fit_trials is not None:
                fit_trials.close()
            if raised:
                pool.release_unused()
                pool.set_limit(budget, drain=True)
            # The trials are not the run's: their allocations, refusals and peak stay
            # out of its report.
            end = pool.stats()
            self._trial_counts = (end["num_allocs"] - start["num_allocs"], end["num_refusals"] - start["num_refusals"])
            pool.reset_peak()
        self._trial_points = points
        line = _advisor.fit_line(points)
        biggest = max(p.batch_size for p in points if p.fits)
        if line is None:
            size = biggest  # no growth of the peak measured
        else:
            fixed, slope = line
            size = (budget - fixed) / slope
        size = min(size, biggest * (1 + MAX_EXTRAPOLATION), *[p.batch_size - 1 for p in points if not p.fits])
        if line is not None:
            # The line goes through the middle of peaks that vary; every epoch of a run
            # draws again, so the advice keeps NOISE_SPREADS times the spread measured
            # between trials of one size below the budget.
            size -= NOISE_SPREADS * _advisor.peak_spread(points, budget) / line[1]
        size = int(size * (1 - (ADVICE_MARGIN_NOISY if rounds > 1 else ADVICE_MARGIN)))
        if biggest <= b0 or b0 <= size < b0 * (1 + MIN_GROWTH):
            # No larger size fitted, or not much room measured: the running size, which
            # trained, stands.
            size = b0
        fixed, slope = line or (0, 0.0)
        return _advisor.Suggestion(
            batch_size=max(1, min(size, self._num_samples())), fixed_bytes=int(fixed), per_sample_bytes=float(slope),
            target_bytes=budget, measured=True,
            method=f"{len(points)} trials ({sum(not p.fits for p in points)} of them refused)")

    def _num_samples(self):
        if _is_arrays(self._fit_x):
            return min(len(a) for a in keras.tree.flatten(self._fit_x))
        return None

    # -- out of memory -----------------------------------------------------------------

    def _wrap_train_function(self):
        model = self.model
        original = getattr(model, "train_function", None)
        if original is None or getattr(original, "_tf_memguard_wrapper", False):
            self._original_train_function = None
            return
        callback = self

        def guarded(*args, **kwargs):
            if callback._in_trials:
                return original(*args, **kwargs)
            try:
                return original(*args, **kwargs)
            except callback._oom_types as e:
                if not isinstance(e, _budget_exceeded_error()):
                    # The frames of the failed step are done: drop their locals, which on
                    # PyTorch hold the step's activations (eager tensors), so that the
                    # trial steps and the retry find the pool as a new step will.
                    traceback.clear_frames(e.__traceback__)
                    callback._explain_oom(e)
                raise

        guarded._tf_memguard_wrapper = True
        self._original_train_function = original
        model.train_function = guarded

    def _unwrap_train_function(self):
        if getattr(self, "_original_train_function", None) is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None

    def _explain_oom(self, error):
        self._unwrap_train_function()
        _core.set_profile_batch(0)
        refusal = self._pool.last_refusal()
        ours = refusal is not None and self._start["num_refusals"] < self._pool.stats()["num_refusals"]
        message = self._oom_message(refusal if ours else None)
        self._oom = message
        note = "tf_memguard: " + message
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python < 3.11
            error._message = f"{error.message}\n\n{note}"
        self._finish()

    def _oom_message(self, refusal):
        b0 = self._run_batch
        budget = self._budget
        if refusal is None:
            return (f"{self._device}: {_backend.framework_name()} ran out of memory, but not in tf_memguard's pool "
                    "(no request was refused); the budget is not what stopped it.")
        req = refusal["requested_bytes"]
        outside = refusal["overshoot_bytes_in_use"] + refusal["passthrough_bytes_in_use"]
        head = (f"{self._device}: cannot allocate {format_bytes(req)} ({req} bytes): "
                f"{format_bytes(refusal['bytes_in_use'] - outside)} of the {format_bytes(refusal['bytes_limit'])} "
                f"budget in use, largest free block {_largest_free(refusal)}")
        if refusal["overshoot_bytes_in_use"]:
            head += (f" ({format_bytes(refusal['overshoot_bytes_in_use'])} more granted over the budget to "
                     "requests TensorFlow cannot survive a refusal of, such as numpy inputs)")
        head += "."
        size, how = self._oom_suggestion(refusal)
        if size and b0 and size < b0:
            advice = (f" Reduce the batch size to {how}{size} (now {b0}) or pass a larger max_bytes to "
                      "tf_memguard.install().")
        elif b0:
            advice = (f" No smaller batch size was found to fit (now {b0}): pass a larger max_bytes to "
                      "tf_memguard.install().")
        else:
            advice = " Reduce the batch size or pass a larger max_bytes to tf_memguard.install()."
        if size:
            self._suggestion = _advisor.Suggestion(size, 0, 0.0, budget, method=(
                "trial steps after the out-of-memory error" if not how else
                "the refused step (an estimate on the safe side)"))
        return head + advice

    def _oom_suggestion(self, refusal):
        """(batch size, "" if measured else "about ") after a refused step.

        With array data, up to ``oom_trials`` trial steps measure it (weights and
        optimizer state restored). Without arrays (or when no trial fits), an estimate:
        the refused step needed at least what was live plus the request, its
        batch-shaped part scaling with the batch; scaled by OOM_SAFETY, since that need is
        a lower bound.
        """
        b0 = self._run_batch
        if not b0 or not self._budget:
            return None, "about "
        outside = refusal["overshoot_bytes_in_use"] + refusal["passthrough_bytes_in_use"]
        needed = refusal["bytes_in_use"] - outside + refusal["requested_bytes"]
        batch_live = refusal["batch_bytes_in_use"] + (refusal["requested_bytes"] if refusal["requested_batch"] else 0)
        if self.oom_trials and _is_arrays(self._fit_x):
            size = self._measure_after_oom(b0, needed, batch_live)
            if size:
                return size, ""
        if batch_live <= 0:
            # No batch-shaped tensors tagged (only TensorFlow's plugin tags them): count
            # everything the step had added above its base as batch-dependent (safe side).
            batch_live = max(needed - self._start["bytes_in_use"], 0)
        fixed = needed - batch_live
        target = self._budget * (1 - self.headroom)
        if batch_live <= 0 or fixed >= target:
            return None, "about "
        # The need is a lower bound (a refusal in the forward pass comes before the
        # backward pass's gradients): half of the estimate.
        size = int(0.5 * OOM_SAFETY * (target - fixed) / (batch_live / b0))
        return max(1, min(size, b0 - 1)), "about "

    def _measure_after_oom(self, b0, needed, batch_live):
        # Until the exception is gone, fit()'s frames hold the batches it prepared ahead
        # (and its copy of the data, which the retry's copy will replace: it stands for
        # it). So for the trials the budget is raised by what the failed fit() added to
        # the pool since it began, and blocks the size of the retry's prepared batches
        # are kept beside each trial step: a trial is refused when the retry's step
        # would be. Then the budget is put back at once (a region that still holds blocks
        # of the failed fit() drains: it serves nothing and goes back with them).
        pool, budget = self._pool, self._budget

        def pooled(s):
            return s["bytes_in_use"] - s["overshoot_bytes_in_use"] - s["passthrough_bytes_in_use"]

        gc.collect()
        extra = max(pooled(pool.stats()) - pooled(self._start), 0)
        failed = _advisor.Point(batch_size=b0, peak_bytes=needed + extra, batch_bytes=batch_live,
                                base_bytes=self._start["bytes_in_use"], fits=False)
        known = [failed]
        self._in_trials = True
        try:
            if extra:
                pool.set_limit(budget + extra)
            found, _ = _advisor.search(self.model, self._fit_x, self._fit_y, budget + extra, pool,
                                       points=known, trials=self.oom_trials, headroom=self.headroom,
                                       hold=_advisor.fit_holds(self._fit_x, self._fit_y, copies=False,
                                                               framework=_backend.framework()))
        finally:
            self._in_trials = False
            if extra:
                gc.collect()
                pool.release_unused()
                pool.set_limit(budget, drain=True)
        if not found.measured:
            return None
        # A lone trial step meets the budget in one layout of the pool; a run goes
        # through many: leave OOM_SAFETY.
        return max(1, int(found.batch_size * OOM_SAFETY))

    def _stop_for_overshoot(self, stats):
        over = stats["overshoot_bytes_by_kind"]["kernel"]
        message = (f"{self._device}: a oneDNN kernel needed more than the {format_bytes(self._budget)} budget "
                   f"(granted over it: {format_bytes(over)} so far; oneDNN kernels crash when an allocation "
                   f"is refused). Stopped after step {self._global_step}.")
        suggestion = self._suggest()
        if suggestion and self._run_batch and suggestion.batch_size < self._run_batch:
            message += f" Reduce the batch size to about {suggestion.batch_size} (now {self._run_batch})"
        else:
            message += " Reduce the batch size"
        message += (", pass a larger max_bytes to tf_memguard.install(), or start Python with "
                    "TF_ENABLE_ONEDNN_OPTS=0 for a hard budget.")
        self._oom = message
        self._unwrap_train_function()
        self._finish()
        raise _budget_exceeded_error()("tf_memguard: " + message)

    # -- the report --------------------------------------------------------------------

    def _finish(self):
        s = self._pool.stats()
        if self._suggestion is None and self._budget and self._points:
            self._suggest()
        cfg = _install.config(self._device)
        over = {k: v - self._start["overshoot_bytes_by_kind"][k] for k, v in s["overshoot_bytes_by_kind"].items()}
        peak = max([r.peak_bytes for r in self._records] + [p for _, p, _, _ in self._steps] +
                   [s["window_peak_bytes_in_use"]])
        rep = _report.Report(
            device=self._device, budget_bytes=self._budget,
            predating_bytes=cfg.predating_bytes if cfg else 0,
            epochs=list(self._records), steps=list(self._steps), peak_bytes=peak,
            allocs=s["num_allocs"] - self._start["num_allocs"] - self._trial_counts[0],
            refusals=s["num_refusals"] - self._start["num_refusals"] - self._trial_counts[1],
            overshoot_bytes_by_kind=over, batch_size=self._run_batch,
            suggested_batch_size=self._suggestion.batch_size if self._suggestion else None,
            suggestion_method=self._suggestion.method if self._suggestion else "",
            leak=_report.leak_verdict(self._live_at_end, self.leak_epochs, peak=peak),
            oom=self._oom,
            process_peak_rss_bytes=_report.process_peak_rss() if self._device == "CPU:0" else 0)
        self._report = rep
        _report.set_last(rep)
        if self._talks():
            print(rep)

    @property
    def report(self):
        """The report of this callback's latest run (None before one ends)."""
        return getattr(self, "_report", None)
