"""The advice and the words of a run on Keras' JAX backend (XlaRun): the batch size the
compiled step says fits, and why a step was refused."""
import dataclasses

from tf_memguard import _advice, _fit_args, _xla, _xla_step
from tf_memguard._units import format_bytes


def advice_text(run, below=None):
    """The sentence naming the size that fits (below `below`), or ""; the Suggestion is
    kept as run.last_suggestion."""
    s = suggestion(run, below=below)
    run.last_suggestion = s
    return _advice.advice_sentence(s, run.run_batch) if s else ""


def suggestion(run, below=None):
    """The Suggestion for the budget from the compiled step (a few more compilations at
    the sizes the line names; only a compiled size is suggested)."""
    if not run.budget or run.model is None:
        return None
    at_most = run.samples or None
    if below:
        at_most = min(at_most or below - 1, below - 1)
    run.model.residual = run.residual
    fixed = _fit_args.fixed_batch_size(run.cb.model)
    if fixed:  # the only size the model runs: no other is compiled
        return _advice.suggest(run.model, run.budget, running=run.run_batch, at_most=at_most, method=method(run),
                               fixed=fixed)
    size = _xla_step.verified_largest(run.model, run.compiler, run.budget, at_most=at_most, oom=_xla.is_oom,
                                      multiple=len(run.devices))
    if not run.model.points:
        return None
    s = _advice.suggest(run.model, run.budget, running=run.run_batch, at_most=at_most,
                        method=method(run))
    if s.batch_size != size:  # only a size whose compiled step was checked is suggested
        one = max(run.model.budget_for(1), run.budget + (1 << 20)) if size == 0 else 0
        s = dataclasses.replace(s, batch_size=size, predicted_peak_bytes=run.model.budget_for(size) if size else 0,
                                one_sample_bytes=one)
    return s


def method(run):
    """How the suggestion was made (the report's suggestion_method)."""
    sizes = ", ".join(str(p[0]) for p in run.model.points)
    extra = f", {format_bytes(run.residual)} measured beyond it" if run.residual else ""
    if run.model.margin:
        extra += f", {format_bytes(run.model.margin)} kept for a recompile's matmul workspace"
    return f"the step XLA compiled (batch sizes {sizes}{extra})"


def refusal_text(run, batch, compiled, outside, peak):
    """Why the step at `batch` was not run: its compiled size over the budget, or its
    temporaries' one buffer larger than the largest free block."""
    where = "XLA's cap" if run.enforced else "the budget (checked against the compiled step: XLA's CPU client has no cap)"
    free = run.model.largest_free if run.model is not None else 0
    if free and peak <= run.budget:
        return (f"{run.device}: the training step at batch {batch} needs one buffer of {format_bytes(compiled.temp)} "
                f"for its temporaries, and the largest free block under XLA's cap is {format_bytes(free)} (in all "
                f"{format_bytes(peak)} of {format_bytes(run.budget)}); it was not run and the model is unchanged. "
                + advice_text(run, below=batch))
    text = (f"{run.device}: the training step at batch {batch} needs about {format_bytes(peak)} "
            f"({format_bytes(compiled.temp)} of temporaries, {format_bytes(compiled.argument)} of arguments "
            f"(weights, optimizer state, the batch), beside {format_bytes(outside)} live outside it), more than "
            f"{where} of {format_bytes(run.budget)}; it was not run and the model is unchanged. ")
    return text + advice_text(run, below=batch)
