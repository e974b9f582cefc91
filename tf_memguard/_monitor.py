"""Per-step and per-epoch peaks of the budget's account, and the Keras logs.

The account is what the budget answers for: bytes in use in the pool plus what was granted
over the budget, without the bytes allocated before install() (not budgeted). Each step
gets its own window of the pool's peak (reset at its start); an epoch's peak is the
largest of its steps' and of what came between them.
"""
import math
import time

from tf_memguard import _report
from tf_memguard._units import format_bytes

MIB = float(1 << 20)


def account(stats, key="bytes_in_use"):
    """Bytes the budget answers for, from pool stats (`key`: bytes_in_use, or
    window_peak_bytes_in_use for a window's peak)."""
    return max(0, stats[key] - stats["passthrough_bytes_in_use"])


def step_growth(pool, step):
    """(what `step()` returned, the bytes it grew the account by at its peak, the requests
    the pool refused during it) for a step that completed.

    The growth counts from the lower of the account before and after the step: what was
    held at its start and let go during it (freed by the collector, or replaced) is in
    the account before but not at the peak, and would hide as much of the step's own
    growth. On an H200 under Keras' torch backend an evaluation step at 42, run beside
    the data of a call that had run out, grew by 80.7 MiB from the account before it
    where the same step grows by 92.5 MiB, and a batch size scaled from it ran out
    (benchmarks/NOTES.md, 2026-12-06). What a step leaves in use is counted where it
    let nothing go; where it did both, the growth errs low by what it left (an evaluation
    step leaves nothing: 0-3 MiB after whole evaluate() and predict() calls on the H200).

    A refused request in a step that completed was taken by the framework, which then ran
    kernels that need less (PyTorch's cuDNN convolutions try the next plan when their
    workspace is refused): such a step grew by less than it will where there is room."""
    pool.reset_peak()
    stats = pool.stats()
    before, refusals = account(stats), stats["num_refusals"]
    result = step()
    stats = pool.stats()
    growth = max(0, account(stats, "window_peak_bytes_in_use") - min(before, account(stats)))
    return result, growth, stats["num_refusals"] - refusals


class Monitor:
    """Measures a run: call the hooks from the callback's hooks of the same names."""

    def __init__(self, pool, budget):
        self.pool = pool
        self.budget = budget
        self.records = []      # one _report.EpochRecord per finished epoch
        self.steps = []        # (global step, peak, live after, epoch, batch size)
        self.live_at_end = []
        self._epoch = 0
        self._epoch_peak = 0
        self._epoch_start = None
        self._epoch_time = 0.0
        self._global_step = 0
        self._held = 0         # a window's peak kept before steps not the run's reset it

    @property
    def global_step(self):
        return self._global_step

    def peak(self):
        s = self.pool.stats()
        return max([r.peak_bytes for r in self.records] + [p for _, p, _, _, _ in self.steps] +
                   [account(s, "window_peak_bytes_in_use"), self._held])

    def hold_window(self):
        """Keeps the pool's window peak as the run's (steps run after the run's own, which
        reset the window, must not take it away: a failed validation's)."""
        self._held = max(self._held, account(self.pool.stats(), "window_peak_bytes_in_use"))

    def peaks_at(self, batch_size, skip_first=True):
        """The step peaks measured at `batch_size` so far (without the run's first step,
        which traces the step's function, unless skip_first is False)."""
        return [p for g, p, _, _, b in self.steps if b == batch_size and not (skip_first and g == 0)]

    def epoch_begin(self, epoch):
        self._epoch = epoch
        self._epoch_start = self.pool.stats()
        self._epoch_time = time.perf_counter()
        self._epoch_peak = 0
        self.pool.reset_peak()

    def step_begin(self):
        # What came between the steps (the iterator's work, other callbacks) counts too.
        self._epoch_peak = max(self._epoch_peak, account(self.pool.stats(), "window_peak_bytes_in_use"))
        self.pool.reset_peak()

    def step_end(self, batch_size):
        s = self.pool.stats()
        peak = account(s, "window_peak_bytes_in_use")
        self._epoch_peak = max(self._epoch_peak, peak)
        self.steps.append((self._global_step, peak, account(s), self._epoch, batch_size))
        self._global_step += 1
        self.pool.reset_peak()
        return s

    def epoch_end(self, epoch, logs, talk):
        """Records the epoch and writes memguard_peak_mib (and memguard_budget_fraction with
        a budget) into `logs`: plain floats, for History, CSVLogger and TensorBoard, and
        short enough for Keras' progress line."""
        s = self.pool.stats()
        peak = max(self._epoch_peak, account(s, "window_peak_bytes_in_use"))
        self.pool.reset_peak()
        budget = self.budget
        start = self._epoch_start or s
        record = _report.EpochRecord(
            epoch=epoch + 1, peak_bytes=peak, budget_fraction=peak / budget if budget else math.nan,
            allocs=s["num_allocs"] - start["num_allocs"], refusals=s["num_refusals"] - start["num_refusals"],
            fragmentation=s["fragmentation"], live_bytes=account(s), seconds=time.perf_counter() - self._epoch_time)
        self.records.append(record)
        self.live_at_end.append(account(s))
        logs["memguard_peak_mib"] = round(peak / MIB, 2)
        if budget:
            logs["memguard_budget_fraction"] = round(peak / budget, 4)
        if talk:
            if budget:
                print(f"epoch {epoch + 1}: peak {format_bytes(peak)} of {format_bytes(budget)} "
                      f"({100 * peak / budget:.0f}%)")
            else:
                print(f"epoch {epoch + 1}: peak {format_bytes(peak)} (no budget installed)")
        return record
