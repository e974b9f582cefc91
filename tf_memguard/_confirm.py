"""Before the report names a batch size larger than the run's: a short run of fit() at it.

The memory model draws a line through each block of the steps it saw, and a line cannot
show what a kernel does only at larger sizes. TensorFlow's CPU Conv3D backprop kernels
take a fixed scratch buffer of a whole group of images (the L3 cache's worth; 290 MiB for
keras.io's 3D CNN at 32x32x16 on this machine) only once the batch's tensors are large
enough for that buffer to be at most 25 times their size, and run a slower kernel with
no buffer below that (conv_grad_ops_3d.cc, kMaxTempAllocationOverhead): from steps at 14
the model named 85 under 512 MiB, where every size from 16 needs the buffer, and 85 ran
out at once. So a size above the running one is named only once a step at it completed,
in a short run of fit() on all the data (its requests not waiting for frees, as the
memory model's steps): the model picks where to look, the runs decide, as after an
out-of-memory error and in find_batch_size. A refused run shows the model short there:
the next size is the largest that fits both the model and the model of the refused step
(the retry's first step, lined up with the run's template; a block only it made is
fixed below its size), at least RUN_SPREAD below the refused size (as after an
out-of-memory error: within it a completion says as little as a refusal; a SimCLR-style
loss whose model fell short, before blocks of batch x batch were modelled, was refused
at 2,680, 2,679 and 2,678), and halfway to it where that is no higher or after a second
refusal. The answer is the
largest size that completed, and at least the running size, which trained.

The runs are made when the suggestion is first read (report().suggested_batch_size), not
at the run's end: until fit() returns, its copy of the arrays is still in the pool, and a
short run beside it would need the budget twice over for the data (the zoo's GRU: 453 was
refused beside it, and trains).
"""
import dataclasses
import warnings
import weakref

from tf_memguard import _recording
from tf_memguard._memory_model import RUN_SPREAD, StepModel, StepModels

# Short runs at most (one step each): the suggestion, then two sizes below a refusal.
CONFIRM_RUNS = 3


def with_model(models, model):
    """StepModels of `models` (a StepModel or StepModels) and `model`, one level deep (as
    a report saves and loads them)."""
    if isinstance(models, StepModels):
        return StepModels(models.models + [model], models.domains + ["all"], models.samples)
    return StepModels([models, model])


def confirmed(sampler, keras_model, model, suggestion, budget):
    """`suggestion` (an _advice.Suggestion of `model`, the run's StepModels) as a short run
    at its size shows it, or as the runs below a refusal leave it: unchanged when it is no
    larger than the running size (sampler.b0, which trained), or when a step at it
    completed; else the largest size whose step completed (at least the running size),
    its method saying so. Unchanged too where no short run can be made (no arrays, and no
    dataset to sample them from). Returns it, and the model the report saves (for the
    what-if): `model`, or where a run was refused, `model` short by what the refusals
    showed (StepModel.with_shortfall) with the refused steps' models beside it."""
    size = suggestion.batch_size if suggestion is not None else 0
    good = sampler.b0
    if size <= good or not sampler.data.usable or not sampler.data.sample_dataset(size) or \
            (sampler.data.n or 0) < size:
        return suggestion, model
    base = sampler.template or sampler.first
    refused, current, short, failed_models = [], model, 0.0, []
    for _ in range(CONFIRM_RUNS):
        trace = sampler.short_fit(keras_model, size, all_samples=True, steps=1)
        if trace is not None and trace.complete:
            good = trace.batch_size  # the size that ran (a multiple of a strategy's replicas)
            break
        refused.append(size)
        # Short there by at least what its replay left of the budget, per sample.
        short = max(short, (budget - model.need(size)["peak_account"]) / size)
        if trace is not None and base is not None:
            failed = StepModel.build(trace, base, first=True, epoch=sampler.data.epoch, fresh=False)
            failed_models.append(failed)
            current = with_model(current, failed)
        nxt = min(current.largest_fitting(budget, at_most=size - 1), int(size / (1 + RUN_SPREAD)))
        if len(refused) > 1:
            # Shown wrong twice: halfway, as bisection (the README's CNN under 128 MiB, run at
            # 64, was named about 520 in one CI draw; 520 and 485 were refused, then 432,
            # and the answer was 64, where about 350 trains).
            nxt = min(nxt, (good + size) // 2)
        if nxt <= good:
            nxt = (good + size) // 2
        if nxt <= good:
            break
        size = nxt
    if not refused:
        return dataclasses.replace(suggestion, method=suggestion.method + f"; a step at {good} completed"), current
    # The report's model (the what-if's) keeps what the refusals showed: each model of the
    # run with the shortfall as one more batch-shaped block at its start, and the refused
    # steps' models beside them.
    ours = model if isinstance(model, StepModels) else StepModels([model])
    shown = StepModels([m.with_shortfall(short, _recording.SHORTFALL_FLAGS) for m in ours.models] + failed_models,
                       ours.domains + ["all"] * len(failed_models), ours.samples)
    what = (f"; short runs at {', '.join(str(b) for b in refused)} were refused (the steps recorded did not show "
            f"all that larger sizes need), so the largest size that ran, {good}")
    return dataclasses.replace(suggestion, batch_size=int(good), method=suggestion.method + what,
                               predicted_peak_bytes=int(model.need(good)["peak_account"])), shown


def pending(callback):
    """At the end of `callback`'s run (MemGuardCallback): the resolver() of its suggestion
    where it names a size above the run's (a size above it is named once a step at it
    completed, run when the suggestion is first read: fit()'s copy of the data is in the
    pool now), else None."""
    s, sampler = callback._suggestion, callback._sampler
    if not (sampler and s and s.batch_size > callback._run_batch and callback._cluster is None):
        return None
    if not sampler.data.usable:
        # A generator or a PyDataset: no step at another size can be taken from its batches.
        callback._suggestion = dataclasses.replace(s, method=s.method + "; not confirmed by a step at it (a "
                                                   "generator or PyDataset makes its own batches)")
        return None
    return resolver(callback)


def resolver(callback):
    """The report's pending suggestion of `callback`'s run (MemGuardCallback), confirmed
    when first read (confirmed()), if the Keras model still exists: the report holds it
    weakly, and the callback too (which holds the model while it lives): a report kept
    must not keep the model alive."""
    from tf_memguard import _advice
    keras_model, sampler, owner = weakref.ref(callback.model), callback._sampler, weakref.ref(callback)
    suggestion, budget, running = callback._suggestion, callback._budget, callback._run_batch

    def resolve(report):
        s = suggestion
        m, cb = keras_model(), owner()
        if m is not None and (cb is None or cb._sampler is sampler):  # not a later run's
            try:
                s, shown = confirmed(sampler, m, sampler.model(), suggestion, budget)
                if shown is not sampler.model():
                    # The refused runs' steps go with the report's model: the what-if from
                    # it at another budget said 7,714 fits 96 MiB for a pandas MLP whose
                    # run under 48 MiB had been refused at 3,628 and 3,386 (the steps at
                    # 1,400 and 1,200 under-predict larger sizes); 7,714 ran out there.
                    report.memory_model = shown.to_dict()
            except Exception as e:  # noqa: BLE001 - reading the report must not fail
                warnings.warn(f"tf_memguard: the suggested batch size {suggestion.batch_size} could not be "
                              f"confirmed by a step at it ({type(e).__name__}: {e}); the running size {running} "
                              "trained", stacklevel=4)
                s = dataclasses.replace(suggestion, batch_size=int(running),
                                        method=suggestion.method + f"; not confirmed, so the size that ran, {running}")
            finally:
                sampler.train_end()
            if cb is not None:
                cb._suggestion = s
        else:
            why = "the model is gone" if m is None else "read after the callback's next fit() began"
            s = dataclasses.replace(suggestion, method=suggestion.method + f"; not confirmed by a step ({why})")
        report.suggested_batch_size = s.batch_size
        report.suggestion_method = s.method
        report.advice = _advice.advice_sentence(s, running)
    return resolve
