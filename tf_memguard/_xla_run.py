"""MemGuardCallback's run on Keras' JAX backend: each step checked against the budget from
the step XLA compiled before it runs, per-epoch peaks, the explained out-of-memory error
and a model that stays usable after it.

What breaks a retry after an OOM in fit() on JAX (Keras 3.15's JAXTrainer): fit() takes
the variables' values out of the variables at an epoch's first step (`_purge_model_variables`:
`v._value = None`) and passes them, donated, to the jitted step; a failed step leaves the
variables empty, and the next fit() reads `v.value`, finds None and calls the (freed)
initializer: `TypeError: 'NoneType' object is not callable`. So the guard puts the state
it was given back into the variables when a step does not run. A step refused before it
runs (its compiled size over the budget) donates nothing; one that fails while running has
consumed its donated state, and where the run was near the cap a host copy taken at the
epoch's start is put back instead (the epoch's steps so far are lost; the message says so).

XLA's GPU allocator reports a failed allocation when the step's result is read, not when
the step is dispatched: on the H200, fit(verbose=0) at a batch whose step needed 14.4 GB
under a 3 GiB cap returned normally with every step failed and the weights left as errors
(benchmarks/NOTES.md, "A fit() over XLA's cap returns as if it trained"). The guard reads
the result of the first step at each batch shape, of every step predicted near the cap,
and of each epoch's last step, so that an OOM is raised where it happened.
"""
import itertools
import time

from tf_memguard import _xla, _xla_advice, _xla_step
from tf_memguard._units import format_bytes


class XlaRun:
    """One fit() on JAX under a MemGuardCallback; the callback forwards its hooks here."""

    def __init__(self, callback, device, budget, enforced, run_batch, samples):
        self.cb = callback
        self.device = device
        self.budget = budget          # bytes, 0 without install()
        self.enforced = enforced      # XLA caps the device (GPU); else the budget is checked by prediction
        self.run_batch = run_batch
        self.samples = samples
        self.compiler = None
        self.model = None             # XlaStepModel
        self.steps = []               # (global step, predicted peak, live after (measured or 0), epoch, batch)
        self.step_peaks = {}          # batch size -> predicted peak
        self.oom = None
        self._checked = {}
        self.last_suggestion = None
        self.lost = False
        self.residual = 0
        self.hook_seconds = 0.0       # time in the guard's own work around the steps (benchmarks)
        self.hook_epochs = []         # the same, per epoch
        self._epoch = 0
        self._seen_shapes = set()
        self._snapshot = None
        self._stats_peak = self._peak_now()
        self.on_gpu = device.startswith("GPU")
        # Under a Keras distribution the step runs on each of its devices, the compiled
        # step is per device (_xla_step.state_spec) and so is the budget.
        self.devices = _xla_step.distribution_devices() or [device]
        self.device_epochs = []    # per device, when there are several (Report.devices)
        self._device_start = {d: self._peak_now(d) for d in self.devices}

    # -- measurements --------------------------------------------------------------------

    def _stats(self, device=None):
        try:
            return _xla.memory_stats(device or self.device) or {}
        except RuntimeError:
            return {}

    def _peak_now(self, device=None):
        return int(self._stats(device).get("peak_bytes_in_use", 0))

    def _live_outside(self, state, data):
        """Bytes live on the device outside this step's arguments."""
        s = self._stats()
        if "bytes_in_use" in s:
            on_device = _xla_step.nbytes([a for a in _leaves((state, data)) if hasattr(a, "is_deleted")
                                          and not a.is_deleted()])
            return max(0, int(s["bytes_in_use"]) - on_device)
        import jax
        args = {id(a) for a in _leaves((state, data))}
        return _xla_step.nbytes([a for a in jax.live_arrays() if id(a) not in args])

    def predicted(self, compiled, outside):
        """The step's peak by its compiled size, without the residual."""
        ahead = compiled.data if self.on_gpu else 0  # Keras' JAXEpochIterator: one batch ahead on GPU only
        return outside + compiled.step + ahead

    # -- the guard on model.train_function -----------------------------------------------

    def wrap(self, model):
        current = model.train_function
        run = self

        def guarded(state, iterator):
            data = next(iterator)  # StopIteration goes to fit(), as from Keras' own function
            compiled = None
            try:
                t = time.perf_counter()
                compiled, peak = run.before_step(model, state, data)
                t1 = time.perf_counter()
                logs, new_state = current(state, itertools.chain([data], iterator))
                t2 = time.perf_counter()
                run.after_step(logs, new_state, compiled, peak)
                run.hook_seconds += (t1 - t) + (time.perf_counter() - t2)
            except BaseException as e:
                run.restore(model, state)  # fit() emptied the variables; put the state back
                if _xla.is_oom(e):
                    if compiled is not None and not str(e).startswith("RESOURCE_EXHAUSTED: tf_memguard"):
                        run.explain_runtime_oom(e, compiled, peak)
                    run.cb._xla_failed()
                raise
            return logs, new_state

        guarded._tf_memguard_original = current
        model.train_function = guarded
        return current

    def before_step(self, model, state, data):
        batch = _xla_step.batch_of(data)
        self._last_batch = batch
        checked = self._checked.get(batch)
        if checked is not None:  # this shape was checked in this epoch: the same program, the same memory
            return checked
        if self.compiler is None:
            self.compiler = _xla_step.Compiler(model, data)
        new = batch not in self.compiler.cache
        try:
            compiled = self.compiler.at(batch)
        except Exception as e:
            if _xla.is_oom(e):  # autotuning ran out of memory while compiling
                self.restore(model, state)
                if self.model is None:
                    self.model = _xla_step.XlaStepModel(points=[], fixed=self._live_outside(state, data),
                                                        ahead=1 if self.on_gpu else 0)
                self.oom = (f"{self.device}: compiling the training step at batch {batch} ran out of memory (XLA's "
                            f"autotuning tries algorithms with scratch space under the cap; {str(e).splitlines()[0]}); "
                            "it was not run and the model is unchanged. " + _xla_advice.advice_text(self, below=batch))
                raise self.error(self.oom) from e
            raise
        if new:  # compiling (autotuning on GPU) is not the step: its scratch is not in the epoch's peak
            self._stats_peak = max(self._stats_peak, self._peak_now())
        outside = self._live_outside(state, data)
        raw = self.predicted(compiled, outside)
        peak = raw + self.residual
        if self.model is None:
            self.model = _xla_step.XlaStepModel(points=[], fixed=outside, ahead=1 if self.on_gpu else 0,
                                                method="the compiled step")
        free = int(self._stats().get("largest_free_block_bytes", 0))
        if free:  # the step's temporaries are one buffer: it needs one free block that large
            self.model.largest_free = max(self.model.largest_free, free) if batch != self.run_batch else free
        self.model.add(compiled)
        self.step_peaks[batch] = raw
        if self.budget and (peak > self.budget or not self.model.contiguous_fits(compiled.temp, margin=False)):
            self.restore(model, state)  # nothing was donated: the step did not run
            self.oom = _xla_advice.refusal_text(self, batch, compiled, outside, peak)
            raise self.error(self.oom)
        if self.enforced and self.budget and peak >= self.cb.warn_at * self.budget and self._snapshot is None:
            import jax
            self._snapshot = jax.device_get(state)  # near the cap: a copy to put back if a step fails
        self._checked[batch] = (compiled, peak)
        return compiled, peak

    def after_step(self, logs, state, compiled, peak):
        shape = compiled.batch_size
        near = self.enforced and self.budget and peak >= self.cb.warn_at * self.budget
        if self.enforced and (shape not in self._seen_shapes or near):
            import jax
            jax.block_until_ready(logs)  # XLA reports a failed allocation here
        self._seen_shapes.add(shape)

    def restore(self, model, state):
        """Puts the step's state back into the variables fit() emptied (or the host copy
        of the epoch's start where the step consumed it)."""
        import jax
        groups = (model.trainable_variables, model.non_trainable_variables, model.optimizer.variables,
                  model.metrics_variables)
        lost = False
        for i, (variables, values) in enumerate(zip(groups, state)):
            for j, (v, a) in enumerate(zip(variables, values)):
                if hasattr(a, "is_deleted") and a.is_deleted():
                    if self._snapshot is None:
                        lost = True
                        continue
                    a = jax.device_put(self._snapshot[i][j])
                v._value = a
        model._jax_state_synced = True
        model._jax_state = None
        self.lost = lost

    def error(self, message):
        from tf_memguard._errors import budget_exceeded_error
        # XLA's own words first, so that handlers that look for them catch it too.
        return budget_exceeded_error()("RESOURCE_EXHAUSTED: tf_memguard: " + message)

    # -- the words (_xla_advice) --------------------------------------------------------------

    def suggestion(self, below=None):
        """The Suggestion for the budget from the compiled step (_xla_advice.suggestion)."""
        return _xla_advice.suggestion(self, below=below)

    def explain_runtime_oom(self, error, compiled, peak):
        s = self._stats()
        text = (f"{self.device}: the training step at batch {compiled.batch_size} ran out of memory while running "
                f"(XLA: {str(error).splitlines()[0][:300]}); its compiled step predicted {format_bytes(peak)} of the "
                f"{format_bytes(self.budget)} cap, in use {format_bytes(s.get('bytes_in_use', 0))}, largest free "
                f"block {format_bytes(s.get('largest_free_block_bytes', 0))}. ")
        if getattr(self, "lost", False):
            text += "The step had consumed the model's weights (donated to it) and no copy was kept: rebuild or reload them. "
        elif self._snapshot is not None:
            text += "The model's weights are those of this epoch's start. "
        # The step did not fit though its prediction did: it needs more than the cap.
        raw = self.step_peaks.get(compiled.batch_size, peak)
        self.residual = max(self.residual, self.budget - raw + (1 << 20))
        self.oom = text + _xla_advice.advice_text(self, below=compiled.batch_size)
        if hasattr(error, "add_note"):
            error.add_note("tf_memguard: " + self.oom)

    # -- epochs ----------------------------------------------------------------------------

    def epoch_begin(self, epoch):
        t = time.perf_counter()
        self._epoch_begin(epoch)
        self.hook_seconds += time.perf_counter() - t

    def _epoch_begin(self, epoch):
        self._epoch = epoch
        self._stats_peak = self._peak_now()
        self._device_start = {d: self._peak_now(d) for d in self.devices}
        self._checked = {}
        if self._snapshot is not None:
            self._snapshot = None  # taken again at the next step, from the state fit() passes

    def batch_end(self, batch, global_step):
        size = getattr(self, "_last_batch", self.run_batch)
        peak = self.step_peaks.get(size, 0) + self.residual
        self.steps.append((global_step, peak, 0, self._epoch, size))  # live: read at the epoch's end only

    def epoch_end(self, epoch, model):
        t = time.perf_counter()
        try:
            return self._epoch_end(epoch, model)
        finally:
            self.hook_seconds += time.perf_counter() - t
            self.hook_epochs.append(self.hook_seconds - sum(self.hook_epochs))

    def _epoch_end(self, epoch, model):
        """The epoch's peak: XLA's peak where it rose during the epoch (exact), else the
        largest compiled step's prediction; and where measured, the residual."""
        predicted = max(list(self.step_peaks.values()) if self.step_peaks else [0])
        if self.enforced:
            import jax
            jax.block_until_ready(getattr(model, "_jax_state", None) or [v.value for v in model.variables])
        stats = self._stats()
        measured = int(stats.get("peak_bytes_in_use", 0))
        if self.steps:
            self.steps[-1] = self.steps[-1][:2] + (int(stats.get("bytes_in_use", 0)),) + self.steps[-1][3:]
        if measured > self._stats_peak:
            self.residual = max(self.residual, measured - predicted)
        if len(self.devices) > 1:
            peaks, sources = [], []
            for d in self.devices:
                m = self._peak_now(d)
                rose = m > self._device_start.get(d, 0)
                peaks.append(m if rose else predicted + self.residual)
                sources.append("measured" if rose else "compiled")
            self.device_epochs.append({"epoch": epoch + 1, "peak_bytes": [int(p) for p in peaks],
                                       "budget_bytes": [int(self.budget)] * len(peaks), "source": sources})
        if measured > self._stats_peak:
            return measured, "measured"
        return predicted + self.residual, "compiled"


def _leaves(tree):
    import jax
    return jax.tree_util.tree_leaves(tree)
