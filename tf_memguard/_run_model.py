"""The StepModels a run's recorded steps make (StepSampler.model): the template's, the
steepest order's, the first step's and, where the batch size divides the samples, the
short fit()'s lone step's, for the sizes that do not (see _steps' docstring)."""
import numpy as np

from tf_memguard import _core, _recording
from tf_memguard._memory_model import ONE_DRAW_SPREAD, RUN_SPREAD, StepModel, StepModels
from tf_memguard._step_trace import _ALLOC, _FREE, _OVERSHOOT, KINDS, kind_of


def models_of(sampler, observed_peak=0):
    """The StepModels of `sampler`'s recorded steps (at least one complete: the template or
    the first step), with the template's spread from `observed_peak` (the highest step
    peak fit() showed at b0)."""
    order = sampler.order_bytes()

    def garbage(trace):
        # What a fresh fit()'s build leaves into its first steps on Keras' torch backend,
        # at the trace's batch size (_recording.build_garbage_rate): the run's own steps ran
        # without it (collected as the fit() began); a fresh process's first fit() at the
        # size asked about meets it.
        return _recording.garbage_at(sampler.garbage_per_sample, trace.batch_size)

    def steady_of(trace, peak):
        return StepModel.build(trace, sampler.other, observed_peak=peak or None,
                               extra_start=_recording.joined(unmet_prepared(sampler, trace),
                                                             sampler.data.unmet_copies(trace), garbage(trace)),
                               epoch=sampler.data.epoch, order_bytes=order, layout_bytes=sampler.layout_bytes())
    steady = steady_of(sampler.template, observed_peak) if sampler.template is not None else None
    # The steepest order too (sampler.steep), with its own peak: the template's order
    # is the highest at b0, not at the size asked about. The zoo's wide MLP at 174
    # (50 MiB): its templates' peaks were alike in every process (47.39 MiB), but
    # scaled to 348 their replays needed 47.9 to 49.6 MiB (a step at 348: 49.6),
    # and the advice named 298 to 446 from process to process (348 trains).
    steep = steady_of(sampler.steep, sampler.steep_peak) \
        if sampler.steep is not None and sampler.steep is not sampler.template else None
    # (Not the first step's: a run's first step meets the pipeline as it starts.)
    # (Its copies: the training arrays', never the validation arrays', which a run's
    # first step is always without.)
    alone = sampler.template is None and sampler.steep is None
    # A first step alone (a run stopped after it: XLA's buffers or oneDNN's kernels
    # granted over the budget) stands for the steps after it: what it made and kept
    # (the optimizer's slots, where fit() builds them in it) is live at their start,
    # and it is one draw of the orders, which the steps after a fit()'s first peaked
    # up to 1/7 of their growth above (ONE_DRAW_SPREAD). keras.applications'
    # ConvNeXtTiny with AdamW under 1,100 MiB at 171: its first step began with 112
    # MiB and peaked at 1,122; the steps after it began with 329 and peaked at 1,253
    # to 1,277, and the model of the first step alone named 200, then 149, which
    # XLA's buffers passed the budget at.
    # (What the first step made once and kept, which the steady steps begin with: fixed in
    # both models; _model_build.kept_state.)
    first = StepModel.build(sampler.first, sampler.other, first=True, epoch=sampler.data.epoch, order_bytes=order,
                            steady=sampler.template or sampler.steep,
                            extra_start=_recording.joined(
                                sampler.data.unmet_copies(sampler.first, validation=False),
                                kept_blocks(sampler.first) if alone else None, garbage(sampler.first)),
                            unseen_share=ONE_DRAW_SPREAD if alone else RUN_SPREAD) \
        if sampler.first is not None else None
    domain = "static" if sampler.static else "all"
    models, domains = [steady, first, steep], [domain, domain, domain]
    start = sampler.template or sampler.first
    if sampler.static and sampler.lone is not None and sampler.lone.complete:
        # The other trace: the short fit()'s step, for the sizes that do not divide
        # the samples.
        # (The run's layout too: the retry runs epochs on the pool.)
        models.append(StepModel.build(sampler.lone, start, epoch=sampler.data.epoch, order_bytes=order,
                                      order_batch=sampler.b0,
                                      layout_bytes=sampler.layout_bytes(),
                                      extra_start=_recording.joined(sampler.data.unmet_copies(sampler.lone),
                                                                    sampler.lone_extra, garbage(sampler.lone))))
        domains.append("dynamic")
    return StepModels(models, domains, samples=sampler.data.n if sampler.tf else None)


def unmet_prepared(sampler, trace):
    """The batches prepared ahead that other steps at b0 met and `trace` did not (see
    _recording.unmet_prepared), or None. On the zoo's wide MLP the step that peaked
    highest once began with none of the three prepared batches (2 MiB at 340) other
    steps began with, and its model named 369 where 350 ran out; the same run's steps
    with them named 336."""
    if trace is None or trace.batch_size != sampler.b0:
        return None
    return _recording.unmet_prepared(trace, sampler.prepared)


def kept_blocks(trace):
    """(sizes, flags) of the blocks `trace`'s step made and had not freed at its end,
    untagged and made by kernels (variables and the optimizer's slots, where the step
    built them), or None: live at the start of the steps after it."""
    live = {}
    for op, addr, size, flags in zip(trace.op.tolist(), trace.address.tolist(), trace.size.tolist(),
                                     trace.flags.tolist()):
        if op in (_ALLOC, _OVERSHOOT) and addr:
            live[addr] = (size, flags)
        elif op == _FREE:
            live.pop(addr, None)
    kernel = KINDS.index("kernel")
    kept = [(size, flags) for size, flags in live.values() if not flags & _core.ALLOC_BATCH and kind_of(flags) == kernel]
    if not kept:
        return None
    return (np.array([k[0] for k in kept], dtype=np.float64),
            np.array([k[1] & ~_core.ALLOC_MUST_SUCCEED for k in kept], dtype=np.uint32))
