"""MemGuardCallback's hooks on Keras' JAX backend (a mixin): the run is an _xla_run.XlaRun,
the epochs go into the same logs and Report as on the other backends."""
import math
import time
import warnings

from tf_memguard import _fit_args, _install, _report, _xla, _xla_run
from tf_memguard._monitor import MIB
from tf_memguard._units import format_bytes


class XlaHooks:
    _xla = None

    @property
    def async_safe(self):
        """On JAX, Keras may call on_train_batch_end from its callback thread: the hook only
        appends a record. Without it Keras turns every step's logs into Python numbers in
        the loop, a device synchronization per step (keras/src/callbacks/callback_list.py):
        the H200 run before this read epochs 1.34x (CNN) and 1.57x (transformer) as long.
        Elsewhere False: the pool's per-step window must be read between the steps."""
        from tf_memguard import _backend
        return _backend.framework() == "jax"

    def _xla_train_begin(self):
        device = _install.resolve_device(self.device)
        cfg = _install.config(device)
        enforced = bool(cfg and cfg.enforced)
        budget = 0
        if cfg is not None:
            # XLA's limit can be its rounding above what was asked: the smaller of the two.
            budget = min(_xla.cap(device, cfg.max_bytes) or cfg.max_bytes, cfg.max_bytes) if enforced \
                else cfg.max_bytes
        fit_args = _fit_args.fit_arguments()
        run_batch = self.batch_size or _fit_args.batch_size(fit_args)
        self._device, self._budget, self._run_batch = device, budget, run_batch
        self._n = _fit_args.training_samples(fit_args)
        self._xla = _xla_run.XlaRun(self, device, budget, enforced, run_batch, self._n)
        self._xla_records, self._xla_sources, self._xla_step = [], [], 0
        self._report, self._warned, self._suggestion = None, False, None
        self._xla_wrapped = self._xla.wrap(self.model) if getattr(self.model, "train_function", None) else None

    def _xla_epoch_begin(self, epoch):
        self._xla.epoch_begin(epoch)
        self._xla_t0 = time.perf_counter()

    def _xla_batch_end(self, batch):
        self._xla.batch_end(batch, self._xla_step)
        self._xla_step += 1

    def _xla_epoch_end(self, epoch, logs):
        peak, source = self._xla.epoch_end(epoch, self.model)
        budget = self._budget
        live = self._xla.steps[-1][2] if self._xla.steps else 0
        self._xla_records.append(_report.EpochRecord(
            epoch=epoch + 1, peak_bytes=int(peak), budget_fraction=peak / budget if budget else math.nan, allocs=0,
            refusals=0, fragmentation=0.0, live_bytes=int(live), seconds=time.perf_counter() - self._xla_t0))
        self._xla_sources.append(source)
        logs["memguard_peak_mib"] = round(peak / MIB, 2)
        if budget:
            logs["memguard_budget_fraction"] = round(peak / budget, 4)
        if self._talks():
            of = f" of {format_bytes(budget)} ({100 * peak / budget:.0f}%)" if budget else " (no budget installed)"
            print(f"epoch {epoch + 1}: peak {format_bytes(peak)}{of}, {source}")
        if budget and peak >= self.warn_at * budget and not self._warned:
            self._warned = True
            from tf_memguard import _advice
            s = self._xla.suggestion() if self.advice else None
            self._suggestion = s or self._suggestion
            advice = (" " + _advice.advice_sentence(s, self._run_batch)) if s else ""
            warnings.warn(f"tf_memguard: epoch {epoch + 1} peaked at {format_bytes(peak)}, "
                          f"{100 * peak / budget:.0f}% of the {format_bytes(budget)} budget on {self._device}."
                          + advice, stacklevel=3)

    def _xla_train_end(self):
        run = self._xla
        if self._xla_wrapped is not None and getattr(self.model.train_function, "_tf_memguard_original", None):
            self.model.train_function = self._xla_wrapped
        if self.advice and self._suggestion is None:
            try:
                self._suggestion = run.suggestion()
            except Exception as e:  # noqa: BLE001 - advice must not break the end of a run
                warnings.warn(f"tf_memguard: no batch-size advice: {e}", stacklevel=3)
        self._xla_finish()

    def _xla_finish(self):
        from tf_memguard import _advice
        run, s = self._xla, self._suggestion
        cfg = _install.config(self._device)
        peaks = [r.peak_bytes for r in self._xla_records] + [p for _, p, _, _, _ in run.steps]
        sources = sorted(set(self._xla_sources))
        rep = _report.Report(
            device=self._device, budget_bytes=int(self._budget), epochs=list(self._xla_records),
            steps=[t[:4] for t in run.steps], peak_bytes=int(max(peaks, default=0)), batch_size=self._run_batch,
            suggested_batch_size=s.batch_size if s else None, suggestion_method=s.method if s else "",
            advice=_advice.advice_sentence(s, self._run_batch) if s else "",
            leak=_report.leak_verdict([r.live_bytes for r in self._xla_records], self.leak_epochs,
                                      peak=max(peaks, default=0)) if run.enforced else "not measured (XLA's CPU "
                                      "client keeps no statistics)",
            oom=run.oom, memory_model=run.model.to_dict() if run.model is not None and run.model.points else None,
            samples=self._n, peak_source=", ".join(sources) if sources else "",
            budget_kind=("XLA's cap" if run.enforced else "checked against the compiled step") if cfg else "",
            devices={"devices": list(run.devices), "epochs": list(run.device_epochs)} if len(run.devices) > 1
            else None)
        _report.set_last(rep)
        self._report = rep
        if self._talks():
            print(rep)

    def _xla_failed(self):
        """fit() raised out of a step: the report still ends the run."""
        if self._xla is not None and self._report is None:
            if self._xla_wrapped is not None:
                self.model.train_function = self._xla_wrapped
            self._suggestion = self._xla.last_suggestion
            self._xla_finish()
