"""Batch-size advice, all from one memory model of the training step (_memory_model).

The near-budget warning, the report's suggestion, the out-of-memory note, find_batch_size
and the what-if all ask the same question of a StepModel: the largest batch size whose
step, replayed through the pool's own code from the blocks live at its start, fits the
budget. When not even a batch of 1 fits, they say so, and which budget would.
"""
import dataclasses

from tf_memguard import _fit_args
from tf_memguard._fit_args import round_down
from tf_memguard._units import format_bytes


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """A batch size that fits a budget, by the memory model, and how it was found.

    Attributes:
        batch_size: the largest batch size whose step fits; 0 when not even 1 does.
        budget_bytes: the budget it fits.
        predicted_peak_bytes: the model's peak (pooled bytes plus overshoot) at batch_size.
        method: how the model was made ("2 steps recorded (batch sizes 64 and 32)", ...).
        one_sample_bytes: when none fits, the budget a batch of 1 would need (else 0).
        running_bytes: the budget the running batch size would need, when known (else 0).
        fixed_batch: the batch size the model's inputs fix (_fit_args.fixed_batch_size),
            the only one it can run; else 0.
        at_least: the budgets are what a step refused before its end held up to the
            refusal (a model of no complete step): less than the step needs, by what came
            after it.
        once_batch, source_bytes: after a failed fit() on a dataset, the size that fits
            with the `source_bytes` of numpy data made into tensors held now counted once
            (the old dataset replaced or deleted), where batch_size counts them twice
            (held_twice); else 0.
    """

    batch_size: int
    budget_bytes: int
    predicted_peak_bytes: int
    method: str
    one_sample_bytes: int = 0
    running_bytes: int = 0
    fixed_batch: int = 0
    at_least: bool = False
    once_batch: int = 0
    source_bytes: int = 0

    @property
    def fits_none(self):
        return self.batch_size == 0


def suggest(model, budget, running=None, at_most=None, method="", at_least=0, fixed=None, multiple=1):
    """The Suggestion of `model` (a StepModel) for `budget` bytes; `running`: the batch
    size in use (its budget is worked out too when it does not fit); `at_most`: the
    samples there are (no batch is larger); `at_least`: a size known to fit (a step of it
    completed under the budget), which the answer never goes below; `fixed`: the only
    batch size the model can run (its inputs fix it), named if it fits, else none;
    `multiple`: the replicas of a tf.distribute strategy, of which the size must be a
    multiple (_fit_args.runnable)."""
    if fixed:
        fits = (at_most is None or fixed <= at_most) and (at_least == fixed or model.fits(fixed, budget))
        need = 0 if fits else max(model.budget_for(fixed), budget + (1 << 20))
        return Suggestion(batch_size=int(fixed) if fits else 0, budget_bytes=int(budget),
                          predicted_peak_bytes=int(model.need(fixed)["peak_account"]),
                          method=method + f"; the model's inputs fix the batch size at {fixed}",
                          running_bytes=int(need), fixed_batch=int(fixed))
    size = model.largest_fitting(budget, at_most=at_most)
    if round_down(size, multiple) != size:
        size = round_down(size, multiple)
        method += f", rounded down to a multiple of the {multiple} replicas"
    if at_least and (at_most is None or at_least <= at_most):
        size = max(size, at_least)
    peak = model.need(size)["peak_account"] if size else 0
    # Where none fits, a batch of 1 needs more than the budget, whatever a model made from a
    # refused step alone says.
    one = max(model.budget_for(1), budget + (1 << 20)) if size == 0 else 0
    now = model.budget_for(running) if running and (size == 0 or size < running) else 0
    # A model of a refused step alone (no step completed) knows the step up to its refusal.
    partial = size == 0 and not all(getattr(m, "complete", True) for m in getattr(model, "models", [model]))
    return Suggestion(batch_size=int(size), budget_bytes=int(budget), predicted_peak_bytes=int(peak),
                      method=method, one_sample_bytes=int(one), running_bytes=int(now), at_least=partial)


# Said with every size named where install(wait=0) turned the waits off. The memory model
# keeps RUN_SPREAD of a step's growth free for orders of the kernels its recorded steps did
# not show, and the waits near the budget are the rest of its margin (README, "Near the
# budget a kernel's request waits"). Without them a size named can run out: keras.io's
# SAM (two gradient passes per step) under 192 MiB with wait=0 was advised 175-176 and,
# after an OOM, 166, whose retry ran out in 2 of 2 processes; 156 is the most that trains
# with wait=0, 208 with the default wait (benchmarks/NOTES.md, twenty-ninth session).
NO_WAIT_CAVEAT = (" With install(wait=0) the size has no margin for orders of the kernels the recorded steps did not "
                  "show (the default wait gives it) and can run out; install() without wait= for advice to rely on.")


def for_run(keras_model, sampler, monitor, budget, running, samples, model=None, below=None, at_least=0):
    """The Suggestion for `budget` of a run's memory model (`model`, default: the one
    `sampler`'s steps make, its spread from the highest peak `monitor` measured at
    `running`), or None: `below`, a size known not to fit, bounds it; `at_least`, a size
    that ran within the budget; `samples`, the epoch's."""
    if not budget or not sampler:
        return None
    if model is None:
        peaks = monitor.peaks_at(running)
        model = sampler.model(observed_peak=max(peaks) if peaks else 0)
    fixed = _fit_args.fixed_batch_size(keras_model)
    if model is None:
        if fixed and below is not None and below <= fixed:
            # Refused at the only size the model runs, before any step completed.
            return Suggestion(batch_size=0, budget_bytes=int(budget), predicted_peak_bytes=0,
                              method=f"the model's inputs fix the batch size at {fixed}", fixed_batch=int(fixed))
        return None
    at_most = samples if below is None else min(samples or below - 1, below - 1)
    return suggest(model, budget, running=running, at_most=at_most, method=sampler.method(), at_least=at_least,
                   fixed=fixed, multiple=_fit_args.replicas(keras_model))


def near_budget(epoch, peak, budget, device, suggestion, running):
    """The warning of an epoch (0-based) that peaked at `peak` bytes near `budget`."""
    advice = (" " + advice_sentence(suggestion, running)) if suggestion else \
        " Pass batch_size= to MemGuardCallback for a suggestion."
    return (f"tf_memguard: epoch {epoch + 1} peaked at {format_bytes(peak)}, {100 * peak / budget:.0f}% of the "
            f"{format_bytes(budget)} budget on {device}." + advice)


def advice_sentence(s, running):
    """What to do, in a sentence or two (the end of the OOM note and of the warning)."""
    text = _advice_sentence(s, running)
    if not s.fits_none and not s.fixed_batch:
        from tf_memguard import _install
        if _install.waits_off():
            text += NO_WAIT_CAVEAT
    return text


def _advice_sentence(s, running):
    now = f" (now {running})" if running else ""
    if s.fixed_batch:
        if not s.fits_none:
            return f"The model's inputs fix the batch size at {s.fixed_batch}, and it fits."
        need = (f"its step needs about {format_bytes(s.running_bytes)}: pass max_bytes of at least that"
                if s.running_bytes else f"its step does not fit the {format_bytes(s.budget_bytes)} budget: pass a "
                                        "larger max_bytes")
        return (f"The model's inputs fix the batch size at {s.fixed_batch} (keras.Input(batch_shape=...)), the only "
                f"one it can run, and {need} to tf_memguard.install(), or build the model's inputs for a smaller "
                "batch size.")
    if s.fits_none:
        about = "more than" if s.at_least else "about"
        text = (f"No batch size fits the {format_bytes(s.budget_bytes)} budget: even a batch of 1 needs {about} "
                f"{format_bytes(s.one_sample_bytes)} for what the step holds whatever its batch size (weights, "
                f"optimizer state, copies of the data, fixed workspaces). Pass max_bytes of at least "
                f"{format_bytes(s.one_sample_bytes)} to tf_memguard.install()")
        if s.running_bytes:
            text += f", or {about} {format_bytes(s.running_bytes)} for the batch size of {running}"
        if s.at_least:
            text += (". These are what the failed step held up to its refusal, and what it would have made after "
                     "it is not known: a fit() with MemGuardCallback under such a budget names the batch size "
                     "that fits")
        return text + "."
    if running and s.batch_size < running:
        text = f"Reduce the batch size to {s.batch_size}{now}, or pass a larger max_bytes to tf_memguard.install()"
        if s.running_bytes:
            text += f" (about {format_bytes(s.running_bytes)} for {running})"
        return text + "."
    return f"A batch size of up to {s.batch_size}{now} fits."


# The report's advice where MemGuardCallback could not read the batch size of fit()'s data
# (bucket_by_sequence_length's batches of several sizes under 200 MiB: the report named
# nothing, and said nothing of why).
UNKNOWN_BATCH_SIZE = ("The batch size of the data given to fit() could not be read: its batches are not all of one "
                      "size (as bucket_by_sequence_length() makes them), or no batch() was found in its pipeline. "
                      "Where they are of one size, pass it as MemGuardCallback(batch_size=...) for the advice; "
                      "batches of several sizes have no one size to advise.")


def what_if(model, budget, sizes=None, at_most=None):
    """Rows (batch size, predicted peak bytes, fits) for `budget`, and the largest that fits.

    `sizes`: the batch sizes to tabulate (default: powers of two around the recorded one,
    and the largest that fits)."""
    largest = model.largest_fitting(budget, at_most=at_most)
    if sizes is None:
        base = model.base_batch
        sizes = sorted({max(1, base // 4), max(1, base // 2), base, base * 2, base * 4, base * 8} |
                       ({largest} if largest else set()))
    rows = []
    for b in sizes:
        need = model.need(b)
        rows.append((int(b), int(need["peak_account"]), bool(model.fits(b, budget))))
    return rows, int(largest)


def format_what_if(rows, largest, budget):
    lines = [f"batch size  predicted peak  fits {format_bytes(budget)}", "-" * 40]
    for b, peak, ok in rows:
        lines.append(f"{b:>10}  {format_bytes(peak):>14}  {'yes' if ok else 'no'}")
    lines.append("-" * 40)
    lines.append(f"largest batch size that fits: {largest}" if largest else
                 "no batch size fits: even a batch of 1 needs more")
    return "\n".join(lines)


def dataset_sentence(s, dataset):
    """What to do with the dataset a fit() that ran out was given, after the sentence on
    `s` (the Suggestion named after the failure, held_twice's): its batches are its own,
    so it is built again at s.batch_size."""
    if _fit_args.is_py_dataset(dataset):
        return f" The PyDataset makes its own batches: make them of {s.batch_size} samples."
    how = _fit_args.dataset_batch_method(dataset)
    # (Keras' dataset utilities, such as timeseries_dataset_from_array, batch with .batch()
    # inside, and take the size as their batch_size.)
    text = (f" The dataset fixes its own batches: build it with .{how}({s.batch_size}), or batch_size="
            f"{s.batch_size} where a Keras utility made it (keras.utils.timeseries_dataset_from_array, "
            "image_dataset_from_directory, ...).")
    if s.once_batch > s.batch_size:
        text += (f" {s.batch_size} fits with the dataset you have and a new one made from the same arrays both "
                 f"referenced ({format_bytes(s.source_bytes)} of numpy data made into tensors is held now: "
                 f"from_tensor_slices copies its arrays so); build the new one in the old one's place (ds = ...), "
                 f"or del the old one first, and {s.once_batch} fits.")
    elif s.source_bytes:
        text += (f" It counts the {format_bytes(s.source_bytes)} of numpy data made into tensors held now "
                 "(from_tensor_slices copies its arrays so) once: build the new dataset in the old one's place "
                 "(ds = ...), or del the old one first; with both referenced no batch size fits.")
    return text


def held_twice(s, model, source_bytes):
    """`s` (a Suggestion named after a failed fit() on a dataset) for a retry that holds
    `source_bytes` twice: numpy data made into tensors still held as the report is read (a
    dataset of from_tensor_slices holds its arrays so), which the suggestion counts once,
    as the dataset the retry uses; a new dataset made from the same arrays while the old one
    is referenced copies them again (the retry of a CNN on a shuffled from_tensor_slices
    pipeline of 47 MiB ran out at the 167 named under 256 MiB; it trained at 167 once the
    old dataset was deleted, and at 127, this answer, with both referenced:
    benchmarks/NOTES.md, thirty-first session). The size that fits so is by `model` (the
    StepModel `s` came from), at the margin `s` keeps below the model's own answer; `s` as
    it is where nothing is held, where no model or size is, or where not even 1 fits with
    both (the advice then says to replace or delete the old dataset)."""
    if model is None or source_bytes <= 0 or s.batch_size <= 0 or s.fixed_batch:
        return s
    alone = model.largest_fitting(s.budget_bytes)
    if alone <= 0:
        return s
    both = model.largest_fitting(s.budget_bytes - source_bytes) if s.budget_bytes > source_bytes else 0
    # The suggestion lies at or below the model's answer (short runs, spreads): the same
    # share of it with both copies held.
    both = min(s.batch_size, both * s.batch_size // alone if alone > s.batch_size else both)
    if both <= 0:
        return dataclasses.replace(s, source_bytes=int(source_bytes))
    if both >= s.batch_size:
        return s
    return dataclasses.replace(
        s, batch_size=int(both), once_batch=s.batch_size, source_bytes=int(source_bytes),
        predicted_peak_bytes=int(model.need(both)["peak_account"] + source_bytes),
        method=s.method + f"; with the {format_bytes(source_bytes)} of numpy data made into tensors held now held "
                          f"twice (a dataset made again from the same arrays while the old one is referenced; "
                          f"{s.batch_size} with it once)")
