"""The memory report of a training run: a table for people, JSON for tools, a PNG plot."""
import dataclasses
import json
import resource

from tf_memguard._units import format_bytes

_last = None  # the most recent Report, for report()


@dataclasses.dataclass
class EpochRecord:
    epoch: int
    peak_bytes: int
    budget_fraction: float  # peak / budget, or NaN without a budget
    allocs: int
    refusals: int
    fragmentation: float    # of the pool's free memory at the epoch's end
    live_bytes: int         # bytes in use at the epoch's end
    seconds: float


@dataclasses.dataclass
class Report:
    """What a run under tf_memguard used. ``str(report)`` is a readable table.

    Attributes:
        device: "CPU:0".
        budget_bytes: the budget in force, or 0 without install().
        predating_bytes: bytes allocated before the first install() (not budgeted).
        epochs: one EpochRecord per finished epoch.
        steps: (global step, step peak bytes, bytes in use after the step), per step.
        peak_bytes: the run's peak of bytes in use.
        allocs, refusals: counts over the run.
        waits, waits_served, wait_seconds: kernels' requests over the run that did not fit
            at first and waited for blocks other threads freed (install()'s `wait`); of
            them, those served then; the time those waited, in all.
        overshoot_bytes_by_kind: bytes granted over the budget during the run, by kind.
        batch_size: the batch size the run used, if known.
        suggested_batch_size: the largest batch size that fits the budget by the run's
            memory model (0: none does), or None; suggestion_method says which steps the
            model was made from. After an out-of-memory error it is worked out when first
            read (short runs of fit() at smaller sizes, the model restored after
            them): read it after the except block and gc.collect(), when the failed
            fit()'s data is no longer in the pool.
        advice: what to do, in a sentence (the batch size that fits, or that none does
            and which budget would).
        leak: the leak verdict ("no leak", "possible leak: ...", "too few epochs to tell").
        oom: the out-of-memory explanation, if the run failed for lack of memory.
        process_peak_rss_bytes: the process's peak resident memory (all of it: tensors,
            the framework's own buffers outside its allocator, Python).
        memory_model: the memory model of the run's training step (a StepModel as a
            dict), for `python -m tf_memguard what-if`; None when none was made.
        samples: the training samples, when known (no batch is larger).
        peak_source: on Keras' JAX backend, where the epochs' peaks come from: "measured"
            (XLA's peak rose during the epoch: exact) or "compiled" (the compiled step's
            size plus what was live beside it: a prediction); empty elsewhere.
        budget_kind: on JAX, "XLA's cap" (GPU) or "checked against the compiled step" (CPU).
        devices: on Keras' JAX backend under a Keras distribution (DataParallel,
            ModelParallel), each device's epochs: {"devices": names, "epochs": [{"epoch",
            "peak_bytes", "budget_bytes", "source"}, ...]}, the peaks XLA's own per device
            where they rose ("measured"), else the compiled step's per device; None elsewhere.
        cluster: in a multi-worker run (MultiWorkerMirroredStrategy), every worker's
            epochs, gathered at each epoch's end: {"worker": this worker, "workers":
            names in task order, "epochs": [{"epoch", "peak_bytes", "budget_bytes",
            "live_bytes"}, ...], one list entry per worker}; None elsewhere.
    """

    device: str = "CPU:0"
    budget_bytes: int = 0
    predating_bytes: int = 0
    epochs: list = dataclasses.field(default_factory=list)
    steps: list = dataclasses.field(default_factory=list)
    peak_bytes: int = 0
    allocs: int = 0
    refusals: int = 0
    waits: int = 0
    waits_served: int = 0
    wait_seconds: float = 0.0
    overshoot_bytes_by_kind: dict = dataclasses.field(default_factory=dict)
    batch_size: int = None
    suggested_batch_size: int = None
    suggestion_method: str = ""
    advice: str = ""
    leak: str = "too few epochs to tell"
    oom: str = None
    process_peak_rss_bytes: int = 0
    memory_model: dict = None
    samples: int = None
    peak_source: str = ""
    budget_kind: str = ""
    cluster: dict = None
    devices: dict = None

    # Worked out on first reading (after an out-of-memory error; confirmed, when above the
    # running size): a callable that sets them.
    _LAZY = frozenset(("suggested_batch_size", "suggestion_method", "advice", "memory_model"))
    _pending = None

    def __getattribute__(self, name):
        if name in Report._LAZY:
            pending = object.__getattribute__(self, "__dict__").get("_pending")
            if pending is not None:
                self._pending = None
                pending(self)
        return object.__getattribute__(self, name)

    def pending(self):
        """True while the suggestion is still to be worked out (see suggested_batch_size)."""
        return self.__dict__.get("_pending") is not None

    def model(self):
        """The StepModel saved in the report, or None."""
        if not self.memory_model:
            return None
        if self.memory_model.get("kind") == "xla-compiled":
            from tf_memguard._xla_step import XlaStepModel
            return XlaStepModel.from_dict(self.memory_model)
        from tf_memguard._memory_model import StepModel, StepModels
        if "models" in self.memory_model:
            return StepModels.from_dict(self.memory_model)
        return StepModel.from_dict(self.memory_model)

    @classmethod
    def from_json(cls, path):
        """A report written by to_json(path)."""
        with open(path) as f:
            d = json.load(f)
        d["epochs"] = [EpochRecord(**e) for e in d.get("epochs", [])]
        d["steps"] = [tuple(s) for s in d.get("steps", [])]
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})

    def __str__(self):
        budget = format_bytes(self.budget_bytes) if self.budget_bytes else "none (counting only)"
        kind = f": {self.budget_kind}" if self.budget_kind and self.budget_bytes else ""
        lines = [f"tf_memguard memory report ({self.device}, budget {budget}{kind})"]
        header = f"{'epoch':>5} {'peak':>10} {'% budget':>9} {'allocs':>9} {'refused':>8} {'frag':>6} {'live at end':>12}"
        lines.append(header)
        lines.append("-" * len(header))
        for e in self.epochs:
            pct = f"{100 * e.budget_fraction:.1f}%" if self.budget_bytes else "-"
            if self.peak_source:  # JAX: XLA counts no allocations or refusals for us
                counts = f"{'-':>9} {'-':>8} {'-':>6}"
            else:
                counts = f"{e.allocs:>9} {e.refusals:>8} {e.fragmentation:>6.2f}"
            lines.append(f"{e.epoch:>5} {format_bytes(e.peak_bytes):>10} {pct:>9} {counts} "
                         f"{format_bytes(e.live_bytes):>12}")
        if not self.epochs:
            lines.append("  (no epoch finished)")
        lines.append("-" * len(header))
        pct = f" ({100 * self.peak_bytes / self.budget_bytes:.1f}% of budget)" if self.budget_bytes else ""
        if self.peak_source:
            lines.append(f"peak {format_bytes(self.peak_bytes)}{pct}; epochs' peaks {self.peak_source} "
                         "(measured: XLA's own peak; compiled: the step XLA compiled, plus what was live beside it)")
        else:
            lines.append(f"peak {format_bytes(self.peak_bytes)}{pct}; {self.allocs} allocations, "
                         f"{self.refusals} refused")
        if self.waits:
            lines.append(f"requests that waited for blocks other threads freed: {self.waits} "
                         f"({self.waits_served} served then, {self.wait_seconds:.2f} s in all); steps that wait "
                         "run their kernels one after the other, more slowly")
        over = {k: v for k, v in self.overshoot_bytes_by_kind.items() if v}
        if over:
            lines.append("granted over the budget (requests that cannot be refused): " +
                         ", ".join(f"{k} {format_bytes(v)}" for k, v in over.items()))
        if self.predating_bytes:
            lines.append(f"allocated before the budget was set: {format_bytes(self.predating_bytes)}")
        suggested, method = self.__dict__["suggested_batch_size"], self.__dict__["suggestion_method"]
        if self.pending() and suggested:
            now = f" (now {self.batch_size})" if self.batch_size else ""
            lines.append(f"batch size that fits the budget: {suggested}{now} by {method}; confirmed by a step at "
                         "it when report().suggested_batch_size is read")
        elif self.pending():
            lines.append("batch size that fits the budget: worked out when report().suggested_batch_size is "
                         "read (after the except block and gc.collect())")
        elif suggested:
            now = f" (now {self.batch_size})" if self.batch_size else ""
            lines.append(f"batch size that fits the budget: {suggested}{now}, from {method}")
        elif suggested == 0:
            lines.append(f"no batch size fits the budget, by {method}: {self.__dict__['advice']}")
        elif suggested is None and self.__dict__["advice"]:
            lines.append(f"batch size that fits the budget: none named. {self.__dict__['advice']}")
        if self.devices:
            names = self.devices["devices"]
            lines.extend(per_unit_lines(f"per device ({len(names)} devices of Keras' distribution; the budget is each "
                                        "device's):", names, self.devices["epochs"]))
        if self.cluster:
            from tf_memguard._workers import report_lines
            lines.extend(report_lines(self.cluster))
        lines.append(f"leak check: {self.leak}")
        if self.process_peak_rss_bytes:
            lines.append(f"process peak resident memory: {format_bytes(self.process_peak_rss_bytes)} (the budget "
                         "covers tensors; TensorFlow's scratch buffers and Python are outside it)")
        if self.oom:
            lines.append("out of memory: " + self.oom)
        return "\n".join(lines)

    def to_dict(self):
        return dataclasses.asdict(self)

    def to_json(self, path=None):
        """The report as a JSON string; also written to `path` if given."""
        text = json.dumps(self.to_dict(), indent=2, default=float)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def save_plot(self, path):
        """Writes a PNG of memory over training steps (needs matplotlib: pip install
        tf_memguard[plot]): each step's peak, the bytes live after it, the budget, and
        epoch boundaries."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as e:
            raise ImportError("Report.save_plot needs matplotlib: pip install 'tf_memguard[plot]'") from e
        mib = float(1 << 20)
        fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
        if self.steps:
            xs = [s[0] for s in self.steps]
            ax.plot(xs, [s[1] / mib for s in self.steps], lw=1.2, color="tab:blue", label="step peak")
            ax.plot(xs, [s[2] / mib for s in self.steps], lw=1.0, color="tab:green", label="live after step")
        if self.budget_bytes:
            ax.axhline(self.budget_bytes / mib, color="tab:red", ls="--", lw=1.2,
                       label=f"budget {format_bytes(self.budget_bytes)}")
        boundaries = [i for i in range(1, len(self.steps)) if self.steps[i][3] != self.steps[i - 1][3]] \
            if self.steps and len(self.steps[0]) > 3 else []
        for i in boundaries:
            ax.axvline(self.steps[i][0], color="0.8", lw=0.8, zorder=0)
        ax.set_xlabel("training step")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        title = f"tf_memguard: memory per step on {self.device}"
        if self.suggested_batch_size:
            title += f" (suggested batch size {self.suggested_batch_size})"
        ax.set_title(title)
        ax.legend(loc="lower right")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


# Beyond this many workers or devices the report names the highest and the lowest only
# (all of them stay in the Report's dict).
TABLE_UNITS = 8


def per_unit_lines(title, names, epochs):
    """A table of each epoch's peak per worker or device: `epochs`, dicts with "epoch",
    "peak_bytes" and "budget_bytes" (one entry per name each)."""
    lines = [title]
    if not epochs:
        return lines + ["  (no epoch finished)"]

    def pct(e, i):
        b = e["budget_bytes"][i]
        return f" ({100 * e['peak_bytes'][i] / b:.0f}%)" if b else ""
    wide = len(names) <= TABLE_UNITS
    lines.append(f"{'epoch':>5}  {'highest':<28}" + ("".join(f"{n:>16}" for n in names) if wide else f"  {'lowest':<28}"))
    for e in epochs:
        peaks = e["peak_bytes"]
        hi, lo = peaks.index(max(peaks)), peaks.index(min(peaks))
        row = f"{e['epoch']:>5}  {format_bytes(peaks[hi]) + pct(e, hi) + ' ' + names[hi]:<28}"
        if wide:
            row += "".join(f"{format_bytes(p) + pct(e, i):>16}" for i, p in enumerate(peaks))
        else:
            row += f"  {format_bytes(peaks[lo]) + pct(e, lo) + ' ' + names[lo]:<28}"
        lines.append(row)
    return lines


def leak_verdict(live_bytes, epochs=3, min_growth=1 << 20, rel_growth=0.01, peak=0):
    """'possible leak: ...' when the bytes live at epoch end grew in each of the last
    `epochs` epochs by more than max(min_growth, rel_growth * peak)."""
    if len(live_bytes) < epochs + 1:
        return "too few epochs to tell"
    tail = live_bytes[-(epochs + 1):]
    step = max(min_growth, rel_growth * peak)
    if all(b - a > step for a, b in zip(tail, tail[1:])):
        return (f"possible leak: live bytes at epoch end grew {epochs} epochs in a row, "
                f"by {format_bytes(tail[-1] - tail[0])} in all")
    return "no leak"


def process_peak_rss():
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def from_run(device, pool, start, monitor, batch_size, suggestion, oom, model, samples, leak_epochs,
             pending=None, cluster=None):
    """The Report of a MemGuardCallback run (and report()'s from now on): `start`, the
    pool's stats when it began; `monitor`, its _monitor.Monitor; `model`, the memory model
    of its step (or None); `pending`, a callable that sets the suggestion's fields when
    they are first read; `cluster`, the run's _workers.ClusterRecord as a dict."""
    from tf_memguard import _advice, _install
    s = pool.stats()
    cfg = _install.config(device)
    over = {k: v - start["overshoot_bytes_by_kind"][k] for k, v in s["overshoot_bytes_by_kind"].items()}
    peak = monitor.peak()
    rep = Report(
        device=device, budget_bytes=start["bytes_limit"], predating_bytes=cfg.predating_bytes if cfg else 0,
        epochs=list(monitor.records), steps=[t[:4] for t in monitor.steps], peak_bytes=peak,
        allocs=s["num_allocs"] - start["num_allocs"], refusals=s["num_refusals"] - start["num_refusals"],
        waits=max(0, s.get("num_waits", 0) - start.get("num_waits", 0)),
        waits_served=max(0, s.get("num_waits_served", 0) - start.get("num_waits_served", 0)),
        wait_seconds=max(0.0, (s.get("wait_ns", 0) - start.get("wait_ns", 0)) / 1e9),
        overshoot_bytes_by_kind=over, batch_size=batch_size,
        suggested_batch_size=suggestion.batch_size if suggestion else None,
        suggestion_method=suggestion.method if suggestion else "",
        advice=_advice.advice_sentence(suggestion, batch_size) if suggestion else "",
        leak=leak_verdict(monitor.live_at_end, leak_epochs, peak=peak), oom=oom,
        process_peak_rss_bytes=process_peak_rss() if device == "CPU:0" else 0,
        memory_model=model.to_dict() if model is not None else None, samples=samples, cluster=cluster)
    if pending is not None:
        rep._pending = pending
    set_last(rep)
    return rep


def set_last(report):
    global _last
    _last = report


def report(device=None):
    """The memory report of the most recent run with MemGuardCallback; without one, a
    report of the pool's state now (no epochs)."""
    if _last is not None:
        return _last
    from tf_memguard import _install
    device = _install.resolve_device(device)
    s = _install.stats(device)
    cfg = _install.config(device)
    return Report(device=device, budget_bytes=s["bytes_limit"],
                  predating_bytes=cfg.predating_bytes if cfg else 0, peak_bytes=s["peak_bytes_in_use"],
                  allocs=s["num_allocs"], refusals=s["num_refusals"],
                  overshoot_bytes_by_kind=dict(s["overshoot_bytes_by_kind"]),
                  process_peak_rss_bytes=process_peak_rss() if device == "CPU:0" else 0,
                  oom=_last_refusal(device) if s["num_refusals"] else None)


def _last_refusal(device):
    """What the pool last refused, for a report made without MemGuardCallback (a custom
    training loop, train_on_batch): TensorFlow's own error names the tensor's shape, and
    the peak above does not count the request that did not fit (a GradientTape loop whose
    first convolution asked for 112 MiB under 64 MiB read "peak 6.32 MiB (9.9% of
    budget)")."""
    from tf_memguard import _install, _oom
    refusal = _install.last_refusal(device)
    if refusal is None:
        return None
    return ("the last refused request, " + _oom.refused(device, refusal) + " Reduce the batch size or pass a larger "
            "max_bytes to tf_memguard.install(). (fit() with MemGuardCallback explains its out-of-memory errors and "
            "names the batch size that fits; tf_memguard.find_batch_size(model, x, y) finds it for a compiled model.)")
