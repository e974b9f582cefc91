"""MemGuardCallback: per-epoch peaks in the Keras logs, a warning near the budget with a
batch size that fits, the memory report, and out-of-memory errors that explain themselves.

The callback orchestrates: _monitor measures, _steps records the steps the memory model
is made of, _advice asks the model, _failures handles a step that fails (_oom words it),
_guard keeps fit()'s functions, _inference explains a validation, evaluate() or predict()
step that fails, _report keeps the run."""
import warnings

import keras

from tf_memguard import _advice, _backend, _confirm, _dead_models, _fit_args, _fit_run, _guard, _install, _monitor, \
    _recording, _report, _workers
from tf_memguard._errors import budget_exceeded_error
from tf_memguard._failures import FailureHandling, collect_after_failure
from tf_memguard._inference import EvaluationGuard
from tf_memguard._xla_hooks import XlaHooks


def __getattr__(name):
    if name == "BudgetExceededError":
        return budget_exceeded_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class MemGuardCallback(XlaHooks, FailureHandling, EvaluationGuard, keras.callbacks.Callback):
    """Records the memory of every epoch, warns near the budget, and explains an OOM.

    At each epoch's end its peak (of what the budget answers for: tensors in tf_memguard's
    pool, and anything granted over the budget) goes into the Keras logs as
    ``memguard_peak_mib`` and, with a budget installed, ``memguard_budget_fraction``, so
    History, CSVLogger and TensorBoard record them; with Keras verbose, a line per epoch
    ("epoch 3: peak 5.2 GiB of 6.0 GiB (87%)"). At the end a memory report is printed
    (unless silent) and kept for ``tf_memguard.report()``.

    The advice comes from a memory model of the training step (benchmarks/NOTES.md, "How
    the advice works"): one step of the first epoch is recorded as the pool sees it, and a
    second at another batch size (the epoch's partial last batch, or one extra step at half
    the batch size, the model restored exactly); the step scaled to any batch size is then
    replayed through the pool's own code. When an epoch's peak reaches ``warn_at`` of the
    budget, a warning says which batch size fits. When a step does not fit, the backend's
    out-of-memory error (ResourceExhaustedError, torch.OutOfMemoryError) gets a note: the
    request, the budget, what holds the memory, the largest free block, and the batch
    size that fits (or that none does, and which budget would); the model stays usable.
    The failed fit()'s batches stay in the pool until the exception is collected: a
    retry given MemGuardCallback collects them at its start (else call ``gc.collect()``
    after the except block). A step of fit()'s validation, or of evaluate() or
    predict() given the callback, that does not fit gets the note too, with the largest
    validation_batch_size or batch_size of that step that fits (tf_memguard/_inference.py).

    On Keras' JAX backend the memory comes from the step XLA compiled
    (``memory_analysis()``, no run at other sizes): each training step is checked against
    the budget before it runs, and one that does not fit is refused with the explanation
    (a ``JaxRuntimeError`` starting RESOURCE_EXHAUSTED), the model unchanged; an epoch's
    peak is XLA's own where it rose during the epoch, else the compiled step's; the
    advice is the largest batch size whose compiled step fits (benchmarks/NOTES.md).

    The batch size is taken from the argument if given, else from the running fit()
    call's ``batch_size`` for array data (Keras' default of 32 when it is None), else from
    a ``tf.data`` dataset's static batch dimension or the size its ``batch()`` was given
    (through prefetch, map, shuffle, repeat, cache, take and the like); without it there
    is no advice.

    A leak is flagged when the bytes live at the end of an epoch grew in each of the last
    ``leak_epochs`` epochs by more than 1 MiB and 1% of the peak.

    Args:
        device: the pool to watch. Defaults to the device install() was called for (else
            "CPU:0" on TensorFlow, "GPU:0" on Keras' torch backend).
        warn_at: fraction of the budget at which an epoch's peak draws a warning.
            Defaults to 0.9.
        batch_size: the training batch size, if it cannot be learned from fit().
            Defaults to None.
        verbose: 0 silences the per-epoch lines and the report; "auto" follows fit()'s
            verbose. Defaults to "auto".
        leak_epochs: consecutive epochs of growth that flag a leak. Defaults to 3.
        advice: False records no steps and gives no batch-size advice (the peaks, the
            report and the explained errors stay). Defaults to True.

    Example:
        >>> tf_memguard.install(max_bytes="2GiB")
        >>> model.fit(x, y, batch_size=256, callbacks=[tf_memguard.MemGuardCallback()])
        >>> print(tf_memguard.report())
    """

    def __init__(self, device=None, warn_at=0.9, batch_size=None, verbose="auto", leak_epochs=3, advice=True):
        super().__init__()
        self.device = _install.normalize_device(device) if device is not None else None
        self._xla = None
        self._cluster = None
        self.warn_at = _fit_args.fraction("warn_at", warn_at)
        self.batch_size = _fit_args.positive_int("batch_size", batch_size, none_ok=True)
        if isinstance(verbose, bool) or verbose not in ("auto", 0, 1, 2):
            raise ValueError(f"verbose={verbose!r}: must be 'auto', 0, 1 or 2")
        self.verbose = verbose
        self.leak_epochs = _fit_args.positive_int("leak_epochs", leak_epochs)
        if not isinstance(advice, bool):
            raise ValueError(f"advice={advice!r}: must be True or False")
        self.advice = advice
        self._report = None
        self._run_token = None

    def set_model(self, model):
        _backend.require_keras3_model(model, "MemGuardCallback")
        super().set_model(model)

    # -- per-run state -----------------------------------------------------------------

    def on_train_begin(self, logs=None):
        # Everything per run is reset here, so one instance serves several fit() calls.
        self._xla = None
        self._cluster = None
        if _backend.framework() == "jax":
            self._active = False
            return self._xla_train_begin()
        self._device = _install.resolve_device(self.device)
        _recording.abort_all()  # a run interrupted before this one left nothing switched on
        collect_after_failure()  # the data of a run that failed before this one, out of the pool
        cluster = _workers.cluster_of(self.model)
        self._cluster = _workers.ClusterRecord(cluster) if cluster is not None else None
        self._active = _fit_run.serving(self._device)
        if not self._active:
            return
        self._oom_types = _backend.oom_errors()
        self._dead_watch = _dead_models.Watch()   # what TensorFlow keeps of the model once it is gone
        self._pool = _install.device_pool(self._device)
        self._pool.end_failed_wait()   # a step refused before this fit() has unwound (_guard)
        # Before the run's start is taken: on Keras' torch backend, what the fit()'s build
        # left to the cycle collector, collected.
        garbage = _recording.collect_build_garbage(self._pool)
        self._start = self._pool.stats()
        self._budget = self._start["bytes_limit"]
        fit_args = _fit_args.fit_arguments()
        self._n, self._run_batch, self._sampler = _fit_run.run_of(
            fit_args, self.model, self._pool, self.params, self.batch_size, self.advice, self._cluster is not None, garbage)
        self._monitor = _monitor.Monitor(self._pool, self._budget)
        self._epoch = 0           # of this fit(): one resumed with initial_epoch=5 begins at Keras' 5
        self._first_epoch = None  # (whose first epochs the sampler would not have recorded)
        self._warned = False
        self._oom = None
        self._suggestion = None
        self._over_counts = {k: self._start["overshoots_by_kind"][k] for k in ("kernel", "xla")}
        self._report = None
        self._run_token = object()
        self._wrapped = _guard.wrap(self.model, self)
        self._nested_phase = None
        _guard.wrap_calls(self.model, self)
        _guard.guard_callbacks(fit_args.get("callbacks"), self)

    def _talks(self):
        if self.verbose == "auto":
            return bool(self.params.get("verbose", 1)) if self.params else True
        return bool(self.verbose)

    # -- epochs and steps ----------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        if self._xla is not None:
            return self._xla_epoch_begin(epoch)
        if not self._active:
            return
        self._first_epoch = epoch if self._first_epoch is None else self._first_epoch
        self._epoch = epoch - self._first_epoch
        self._monitor.epoch_begin(epoch)
        if self._sampler:
            self._sampler.epoch_begin(self._epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._active:
            return
        self._monitor.step_begin()
        if self._sampler:
            self._sampler.step_begin(self._epoch, batch)

    def on_train_batch_end(self, batch, logs=None):
        if self._xla is not None:
            return self._xla_batch_end(batch)
        if not self._active:
            return
        if self._sampler:
            self._sampler.step_end(self._epoch, batch)
        s = self._monitor.step_end(_fit_run.step_batch(self._sampler, self.params, batch, self._run_batch))
        for kind in ("xla", "kernel"):
            if s["overshoots_by_kind"][kind] > self._over_counts[kind]:
                self._stop_for_overshoot(kind, s)

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        if self._xla is not None:
            return self._xla_epoch_end(epoch, logs)
        record = self._monitor.epoch_end(epoch, logs, self._talks()) if self._active else None
        if self._active and self._sampler:
            self._sampler.epoch_end(self._epoch, self.model)
            ran = _fit_run.proven_size(self._sampler, self._monitor, self._budget, self._epoch, self._run_batch)
            self._suggestion = self._suggest(at_least=ran) or self._suggestion
        if self._cluster is not None:  # a collective: every worker takes part, active or not
            self._suggestion = self._cluster.epoch_end(epoch, record, self._budget if self._active else 0,
                                                       self._suggestion, logs)
        if not self._active:
            return
        if self._budget and record.peak_bytes >= self.warn_at * self._budget and not self._warned:
            self._warned = True
            warnings.warn(_advice.near_budget(epoch, record.peak_bytes, self._budget, self._device,
                                              self._suggestion, self._run_batch), stacklevel=2)

    def on_train_end(self, logs=None):
        if self._xla is not None:
            return self._xla_train_end()
        if not self._active:
            return
        self._unwrap_train_function()
        self._finish(_confirm.pending(self))

    # -- advice --------------------------------------------------------------------------

    def _suggest(self, model=None, below=None, at_least=0):
        """The memory model's Suggestion for the run's budget, or None (_advice.for_run)."""
        return _advice.for_run(self.model, self._sampler, self._monitor, self._budget, self._run_batch, self._n,
                               model=model, below=below, at_least=at_least)

    # -- the report ----------------------------------------------------------------------

    def _finish(self, pending=None):
        self._dead_watch.end()
        if self._sampler:
            self._sampler.train_end()
        model = self._sampler.model() if self._sampler else None
        self._report = _report.from_run(self._device, self._pool, self._start, self._monitor, self._run_batch,
                                        self._suggestion, self._oom, model, self._n, self.leak_epochs,
                                        pending=pending,
                                        cluster=self._cluster.to_dict() if self._cluster else None)
        if self.advice and not self._run_batch and self._budget and pending is None and not self._report.advice:
            self._report.advice = _advice.UNKNOWN_BATCH_SIZE
        if self._talks():
            print(self._report)

    @property
    def report(self):
        """The report of this callback's latest run (None before one ends)."""
        return self._report
