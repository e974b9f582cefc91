"""MemGuardCallback: per-epoch peaks in the Keras logs, a warning near the budget with a
batch size that fits, the memory report, and out-of-memory errors that explain themselves.

The callback orchestrates: _monitor measures, _steps records the steps the memory model
is made of, _advice asks the model, _oom words the errors, _report keeps the run."""
import inspect
import numbers
import traceback
import warnings
import weakref

import keras

from tf_memguard import _advice, _backend, _core, _install, _monitor, _oom, _recording, _report
from tf_memguard._steps import StepSampler
from tf_memguard._units import format_bytes

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
            "__doc__": """A step went over the budget without the framework raising: requests that cannot
    be refused (XLA's buffers, oneDNN's kernels) were granted over it, so MemGuardCallback
    stopped the run after that step; or TensorFlow could not build the step because a
    constant did not fit. A subclass of the backend's out-of-memory error
    (tf.errors.ResourceExhaustedError, torch.OutOfMemoryError), so its handlers catch it."""})
    return _budget_exceeded[framework]


def __getattr__(name):
    if name == "BudgetExceededError":
        return _budget_exceeded_error()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fit_arguments():
    """The arguments of the Keras fit() call running now (its frame's locals), or {}.
    Keras does not hand callbacks the batch size or the data; fit()'s own frame has them."""
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


def _positive_int(name, value, none_ok=False):
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive int" + (" or None" if none_ok else ""))
    return int(value)


def _fraction(name, value, lo_open, hi_closed):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            (value > 0 if lo_open else value >= 0) and (value <= 1 if hi_closed else value < 1)):
        raise ValueError(f"{name}={value!r}: must be a fraction in {'(' if lo_open else '['}0, "
                         f"1{']' if hi_closed else ')'}")
    return float(value)


_warned_disabled = set()


class MemGuardCallback(keras.callbacks.Callback):
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
    Call ``gc.collect()`` before retrying: the failed fit()'s batches stay in the pool
    until the exception is collected.

    The batch size is taken from the argument if given, else from the running fit()
    call's ``batch_size`` for array data (Keras' default of 32 when it is None), else from
    a ``tf.data`` dataset's static batch dimension; without it there is no advice.

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
        self.warn_at = _fraction("warn_at", warn_at, lo_open=True, hi_closed=True)
        self.batch_size = _positive_int("batch_size", batch_size, none_ok=True)
        if isinstance(verbose, bool) or verbose not in ("auto", 0, 1, 2):
            raise ValueError(f"verbose={verbose!r}: must be 'auto', 0, 1 or 2")
        self.verbose = verbose
        self.leak_epochs = _positive_int("leak_epochs", leak_epochs)
        if not isinstance(advice, bool):
            raise ValueError(f"advice={advice!r}: must be True or False")
        self.advice = advice
        self._report = None

    # -- per-run state -----------------------------------------------------------------

    def on_train_begin(self, logs=None):
        # Everything per run is reset here, so one instance serves several fit() calls.
        self._device = _install.resolve_device(self.device)
        _recording.abort_all()  # a run interrupted before this one left nothing switched on
        self._active = self._check_serving()
        if not self._active:
            return
        self._oom_types = _backend.oom_errors()
        self._pool = _install.device_pool(self._device)
        self._start = self._pool.stats()
        self._budget = self._start["bytes_limit"]
        fit_args = _fit_arguments()
        x, y = fit_args.get("x"), fit_args.get("y")
        arrays = _is_arrays(x)
        self._run_batch = self.batch_size or self._learn_batch_size(fit_args, x, arrays)
        self._n = self._num_samples(x, fit_args) if arrays else None
        self._monitor = _monitor.Monitor(self._pool, self._budget)
        self._sampler = None
        if self.advice and self._run_batch:
            self._sampler = StepSampler(self._pool, self._run_batch, n_samples=self._n,
                                        steps_per_epoch=(self.params or {}).get("steps"),
                                        x=x if arrays else None, y=y if arrays else None)
        self._epoch = 0
        self._warned = False
        self._oom = None
        self._suggestion = None
        self._over_counts = {k: self._start["overshoots_by_kind"][k] for k in ("kernel", "xla")}
        self._report = None
        self._wrap_train_function()

    def _check_serving(self):
        """False, with one warning per reason, when the pool does not see the tensors."""
        if _backend.framework() != "tensorflow":
            return True
        import tensorflow  # noqa: F401  (the plugin is loaded by it)
        state = _core.plugin_state()
        reason = None
        if state & _core.PLUGIN_DISABLED:
            reason = ("tf_memguard's TensorFlow plugin is turned off (TF_MEMGUARD_DISABLE=1): MemGuardCallback "
                      "records nothing. Unset it and restart Python to measure memory.")
        elif state & (_core.PLUGIN_MISMATCH | _core.PLUGIN_GLUE_FAILED):
            reason = "MemGuardCallback records nothing: " + _core.plugin_message()
        elif not state & _core.PLUGIN_REGISTERED:
            reason = ("tf_memguard's TensorFlow plugin is not registered (see its warning at `import tensorflow`): "
                      "MemGuardCallback records nothing.")
        if reason is None:
            return True
        if reason not in _warned_disabled:
            _warned_disabled.add(reason)
            warnings.warn("tf_memguard: " + reason, stacklevel=3)
        return False

    def _learn_batch_size(self, fit_args, x, arrays):
        if arrays:
            return fit_args.get("batch_size") or 32
        spec = getattr(x, "element_spec", None)
        if spec is not None:
            dims = {leaf.shape[0] for leaf in keras.tree.flatten(spec) if getattr(leaf, "shape", None) is not None
                    and len(leaf.shape) > 0 and leaf.shape[0] is not None}
            if len(dims) == 1:
                return int(dims.pop())
        return None

    def _num_samples(self, x, fit_args):
        n = min(len(a) for a in keras.tree.flatten(x))
        split = fit_args.get("validation_split") or 0.0
        if split and fit_args.get("validation_data") is None:
            n = int(-(-n * (1.0 - split) // 1))  # as Keras splits: ceil(n * (1 - split))
        return n

    def _talks(self):
        if self.verbose == "auto":
            return bool(self.params.get("verbose", 1)) if self.params else True
        return bool(self.verbose)

    # -- epochs and steps ----------------------------------------------------------------

    def on_epoch_begin(self, epoch, logs=None):
        if not self._active:
            return
        self._epoch = epoch
        self._monitor.epoch_begin(epoch)
        if self._sampler:
            self._sampler.epoch_begin(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self._active:
            return
        self._monitor.step_begin()
        if self._sampler:
            self._sampler.step_begin(self._epoch, batch)

    def on_train_batch_end(self, batch, logs=None):
        if not self._active:
            return
        if self._sampler:
            self._sampler.step_end(self._epoch, batch)
        s = self._monitor.step_end(self._step_batch(batch))
        for kind in ("xla", "kernel"):
            if s["overshoots_by_kind"][kind] > self._over_counts[kind]:
                self._stop_for_overshoot(kind, s)

    def _step_batch(self, batch):
        sampler = self._sampler
        if sampler and sampler.partial and self.params and batch == self.params.get("steps", 0) - 1:
            return sampler.partial
        return self._run_batch

    def on_epoch_end(self, epoch, logs=None):
        if not self._active:
            return
        logs = logs if logs is not None else {}
        record = self._monitor.epoch_end(epoch, logs, self._talks())
        if self._sampler:
            self._sampler.epoch_end(epoch, self.model)
            self._suggestion = self._suggest() or self._suggestion
        budget = self._budget
        if budget and record.peak_bytes >= self.warn_at * budget and not self._warned:
            self._warned = True
            s = self._suggestion
            advice = (" " + _advice.advice_sentence(s, self._run_batch)) if s else \
                " Pass batch_size= to MemGuardCallback for a suggestion."
            warnings.warn(f"tf_memguard: epoch {epoch + 1} peaked at {format_bytes(record.peak_bytes)}, "
                          f"{100 * record.peak_bytes / budget:.0f}% of the {format_bytes(budget)} budget on "
                          f"{self._device}." + advice, stacklevel=2)

    def on_train_end(self, logs=None):
        if not self._active:
            return
        self._unwrap_train_function()
        self._finish()

    # -- advice --------------------------------------------------------------------------

    def _suggest(self, model=None, below=None):
        """The Suggestion of the memory model for the budget (with `below`: smaller than
        that, a size known not to fit), or None."""
        if not self._budget or not self._sampler:
            return None
        if model is None:
            peaks = self._monitor.peaks_at(self._run_batch)
            model = self._sampler.model(observed_peak=max(peaks) if peaks else 0)
        if model is None:
            return None
        at_most = self._n if below is None else min(self._n or below - 1, below - 1)
        return _advice.suggest(model, self._budget, running=self._run_batch, at_most=at_most,
                               method=self._sampler.method())

    # -- out of memory -------------------------------------------------------------------

    def _wrap_train_function(self):
        model = self.model
        current = getattr(model, "train_function", None)
        # A wrapper left by a run that ended without on_train_end (an exception, Ctrl-C):
        # unwrap it first, whichever callback made it.
        while getattr(current, "_tf_memguard_original", None) is not None:
            current = current._tf_memguard_original
        if current is None:
            self._original_train_function = None
            return
        owner = weakref.ref(self)
        run = object()
        self._run_token = run

        def guarded(*args, **kwargs):
            callback = owner()
            if callback is None or getattr(callback, "_run_token", None) is not run or _recording.in_own_steps():
                return current(*args, **kwargs)
            before = callback._pool.stats()["num_refusals"]
            try:
                return current(*args, **kwargs)
            except callback._oom_types as e:
                if not isinstance(e, _budget_exceeded_error()):
                    # The frames of the failed step are done: drop their locals, which on
                    # PyTorch hold the step's activations, so that the lone steps and the
                    # retry find the pool as a new step will.
                    traceback.clear_frames(e.__traceback__)
                    callback._explain_oom(e)
                raise
            except BaseException as e:
                callback._end_abruptly()
                message = callback._constant_refused(e, before)
                if message:
                    raise _budget_exceeded_error()("tf_memguard: " + message) from e
                raise

        guarded._tf_memguard_original = current
        self._original_train_function = current
        model.train_function = guarded

    def _unwrap_train_function(self):
        original = getattr(self, "_original_train_function", None)
        if original is not None and getattr(self.model, "train_function", None) is not original:
            self.model.train_function = original
        self._original_train_function = None
        self._run_token = None

    def _end_abruptly(self):
        """A run ended by an exception (KeyboardInterrupt too): nothing stays switched on."""
        if self._sampler:
            self._sampler.train_end()
        _core.set_profile_batch(0)
        self._unwrap_train_function()

    def _constant_refused(self, error, refusals_before):
        """The note when TensorFlow could not build the step because the pool refused a
        constant ('Cannot parse tensor from proto'), else None."""
        if _backend.framework() != "tensorflow" or "Cannot parse tensor from proto" not in str(error):
            return None
        refusal = self._pool.last_refusal()
        if refusal is None or refusal["kind"] != "constant" or self._pool.stats()["num_refusals"] <= refusals_before:
            return None
        self._oom = _oom.constant_refused(self._device, refusal, self._suggestion, self._run_batch)
        self._finish()
        return self._oom

    def _explain_oom(self, error):
        if self._sampler:
            self._sampler.failed_step()
        _core.set_profile_batch(0)
        self._unwrap_train_function()
        refusal = self._pool.last_refusal()
        ours = refusal is not None and self._start["num_refusals"] < self._pool.stats()["num_refusals"]
        if not ours:
            message = _oom.not_in_the_pool(self._device, _backend.framework_name())
        else:
            suggestion = None
            if self._sampler and self._budget:
                import gc
                gc.collect()
                try:
                    model = self._sampler.model_after_oom(self.model)
                    suggestion = self._suggest(model, below=self._sampler.too_large) if model is not None else None
                except Exception as e:  # noqa: BLE001 - the explanation must not hide the error
                    warnings.warn(f"tf_memguard: no batch size could be worked out after the out-of-memory error "
                                  f"({type(e).__name__}: {e})", stacklevel=3)
                self._sampler.train_end()
            if suggestion is not None:
                self._suggestion = suggestion
            message = _oom.explain(self._device, refusal, suggestion, self._run_batch)
        self._oom = message
        note = "tf_memguard: " + message
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python < 3.11
            error._message = f"{error.message}\n\n{note}"
        self._finish()

    def _stop_for_overshoot(self, kind, stats):
        over = stats["overshoot_bytes_by_kind"][kind]
        self._over_counts[kind] = stats["overshoots_by_kind"][kind]
        self._end_abruptly()
        self._oom = _oom.overshoot_stop(self._device, kind, over, self._budget, self._monitor.global_step,
                                        self._suggest(), self._run_batch)
        self._finish()
        raise _budget_exceeded_error()("tf_memguard: " + self._oom)

    # -- the report ----------------------------------------------------------------------

    def _finish(self):
        if self._sampler:
            self._sampler.train_end()
        s = self._pool.stats()
        cfg = _install.config(self._device)
        over = {k: v - self._start["overshoot_bytes_by_kind"][k] for k, v in s["overshoot_bytes_by_kind"].items()}
        model = self._sampler.model() if self._sampler else None
        sug = self._suggestion
        rep = _report.Report(
            device=self._device, budget_bytes=self._budget, predating_bytes=cfg.predating_bytes if cfg else 0,
            epochs=list(self._monitor.records), steps=[t[:4] for t in self._monitor.steps],
            peak_bytes=self._monitor.peak(), allocs=s["num_allocs"] - self._start["num_allocs"],
            refusals=s["num_refusals"] - self._start["num_refusals"], overshoot_bytes_by_kind=over,
            batch_size=self._run_batch, suggested_batch_size=sug.batch_size if sug else None,
            suggestion_method=sug.method if sug else "",
            leak=_report.leak_verdict(self._monitor.live_at_end, self.leak_epochs, peak=self._monitor.peak()),
            oom=self._oom, process_peak_rss_bytes=_report.process_peak_rss() if self._device == "CPU:0" else 0,
            memory_model=model.to_dict() if model is not None else None, samples=self._n)
        self._report = rep
        _report.set_last(rep)
        if self._talks():
            print(rep)

    @property
    def report(self):
        """The report of this callback's latest run (None before one ends)."""
        return self._report
