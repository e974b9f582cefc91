"""After an out-of-memory error: the memory model from short fit() runs of the run's own.

The failed fit() recorded its step up to the refusal (the retry's first step must fit
too) and, when it was the run's first size, no complete step. Once the failed fit()'s
data is out of the pool (its exception released), short fit() runs on all the samples at
smaller sizes make the model: down from half the failed size until one completes, then up
where the model says the limit is. The answer is the largest size whose run completed
(and, where the runs went up, whose run of CONFIRM_STEPS steps completed): the model
picks where to look, the runs decide. On a tf.data dataset the short runs are on its first
batches as arrays, with room for what its pipeline holds beside the steps (_dataset_sample).
"""
from tf_memguard import _dataset_sample, _recording
from tf_memguard._memory_model import RUN_SPREAD, StepModel, StepModels, order_gap

# After an OOM at b0 the runs go down from b0 // 2 by this factor until one completes:
# each refused one costs a step up to its refusal, and the largest that completes is then
# within this factor of the limit, close enough for the model of its step to say where the
# limit is (from a batch of 1, the old last resort below b0 // 8, EfficientNetB0's model
# named 9 where 32 trained).
DESCENT = 4
# Runs after an OOM that go up from the size that completed, the model's size then halfway.
ASCENT_RUNS = 3
# The steps of the run that confirms the answer, when the ascent went up: four draws of
# the kernels' order where the short run's recorded step was one (its first step finds
# the step traced by the short run at that size). The ascent ends on a size whose one
# recorded step completed, and of the sizes it tries, the ones that complete are the
# lucky draws: on the zoo, the separable CNN's 399 and the two-input model's 467 (1.09
# and 1.08 of their limits) completed a short run and ran out in the retry; one epoch of the two-input model
# at 442 peaked at 120.7-127.2 MiB of its 128 in its steps and ran out in its fifth. Four
# steps at the limit cost about as much as two short runs.
CONFIRM_STEPS = 4
# The epochs of the run that confirms the answer where an epoch has two full batches or
# fewer (CONFIRM_STEPS would be more than an epoch): two, as the zoo's runs and the
# retries measured here are; up to six steps.
CONFIRM_EPOCHS = 2
# Runs after the ascent at most, confirmations and short runs at halfway sizes together:
# for each of the ascent's ASCENT_RUNS sizes a confirmation and a size halfway below it.
CONFIRM_RUNS = 2 * ASCENT_RUNS
# (RUN_SPREAD, from _memory_model: in batch size, how far apart a completed run and a
# refused one say nothing of each other; the answer after an OOM is at least that much
# below the smallest size refused, settle. In batch size the spread is more than in bytes,
# the step's fixed part not moving.)


def with_unseen_order(trace, pool):
    """A confirmation run's recorded `trace`, its observed peak raised to what an order of
    the kernels it did not meet could peak at: where the highest of its full steps' peaks
    was met once (peaks within a granule of the pool's backing count as one), as far above
    it as it lies above the next one down (as StepSampler.order_bytes takes it, from
    the two or more steps there are). The retry runs as many steps again, each another
    draw: on the zoo's autoencoder (2,048 samples, 240 MiB) the first steps of the two
    epochs of one run at 1,134 peaked at 209.5 and 228.1 MiB, and a confirmed 1,082 ran
    out in its retry."""
    import dataclasses
    if trace is None or not trace.complete or len(trace.step_peaks) < 2:
        return trace
    same = max(int(pool.layout().get("page_bytes", 0) or 0), 1)
    top = max(int(v) for v in trace.step_peaks) + order_gap(trace.step_peaks, same, least=2)
    return dataclasses.replace(trace, observed_peak=max(int(trace.observed_peak), top))


def model_after_oom(sampler, model):
    """After a refused step: `sampler`'s StepModel (a StepSampler's), from short fit()
    runs of its own on all the samples at smaller sizes, run once the failed fit()'s data
    is out of the pool (its exception released): at b0 // 2, then down by DESCENT until
    one completes, then at the size the model of the step that completed says fits, each
    completed step becoming the model's new template. A run that is refused there shows
    the model wrong near that size: the next is halfway between the largest size that
    completed and it. The advice names the largest size that completed (advice_cap),
    once a run of CONFIRM_STEPS steps at it completed too where the runs went up. The
    failed step up to its refusal is the retry's first step, and must fit too. None when
    no complete step could be had."""
    if not needs_steps(sampler):
        return without_runs(sampler)
    # On a tf.data dataset: its first batches, as arrays, for the short runs.
    if not sampler.data.sample_dataset(sampler.b0):
        return None
    budget = sampler.pool.stats()["bytes_limit"]
    copies = sampler.data.copy_sizes()
    room = budget - sum(copies)

    def has_copy(trace):
        bare = _recording.without_blocks(trace, copies, kind="input")
        return len(bare.start_size) == len(trace.start_size) - len(copies)

    # Keras' copy of the arrays is in the pool in some short fit() runs and not in
    # others (benchmarks/NOTES.md, "Keras' copy of the arrays comes and goes"); a line
    # through a step with it and one without would make it shrink with the batch.
    # Once a step without it is met, the models take every step without it and leave
    # room for it; while every step has it, they take the steps as they ran (the copy
    # where it lay: on the two-input model, room instead named 446, which ran out).
    # (On a sample of a dataset the retry makes no copy: the steps are taken without it.)
    without = [bool(copies) and (sampler.data.from_dataset or
                                 sampler.prefix is not None and not has_copy(sampler.prefix))]

    def plain(trace):
        return _recording.without_blocks(trace, copies, kind="input") if without[0] else trace

    def limit():
        # A retry on a dataset makes no copy of arrays: only the short runs on the sample do.
        return room if without[0] and not sampler.data.from_dataset else budget

    # What tf.data had prepared ahead, per sample: the most the failed fit()'s steps
    # and the short runs' steps met (a short run's second step can begin with none of
    # the batches a long run's steps begin with).
    per_sample = [sampler.prepared / sampler.b0,
                  _recording.prepared_bytes(sampler.prefix) / sampler.b0 if sampler.prefix is not None else 0.0]

    def unmet(trace):
        return _recording.unmet_prepared(trace, max(per_sample) * trace.batch_size)

    def build(template, other=None):
        # (The validation arrays' copy too: the short runs have no validation, and the
        # retry's later epochs hold it.)
        extra = _recording.joined(unmet(template), _recording.stale_batches(sampler.data.x, sampler.data.y,
                                                                            template.batch_size, model),
                                  pipeline_extra(sampler), sampler.data.unmet_copies(template, train=False))
        return StepModel.build(plain(template), plain(other) if other is not None else None,
                               extra_start=extra, epoch=sampler.data.epoch)

    # Keras' torch backend (_recording.STALE_BATCHES; see ran()), and TensorFlow's loop of
    # steps per execution (_recording.LOOP_BATCHES).
    stale = _recording.stale_batches(sampler.data.x, sampler.data.y, 1, model) is not None

    def ran(trace):
        # A short run that completed proves its size for a retry that copies the
        # arrays only if it had the copy, or if its step fits with room for it (under
        # 24 MiB, the README's CNN completed a batch of 1 without its 12 MiB copy,
        # where with it nothing fits); for a retry whose steps meet tf.data's
        # prepared batches only if it met them too, or fits with them; and on Keras'
        # torch backend, where no run shows whether the batches before its step's own
        # were still live (_recording.STALE_BATCHES), only if it fits with them; on a
        # sample of a dataset, only if it fits with the pipeline's buffers, which the run
        # on arrays did not meet.
        if trace is None or not trace.complete:
            return False
        per_sample.append(_recording.prepared_bytes(trace) / trace.batch_size)
        if copies and not has_copy(trace):
            without[0] = True
        elif unmet(trace) is None and not stale and not sampler.data.from_dataset:
            return True
        # (The step that ran, at its own size: its layout as the run laid it out, where
        # its order is the only one: StepModel.layout_margin.)
        return build(trace).fits(trace.batch_size, limit(), as_run=True)

    def run_at(size, waits):
        sampler.data.waits = waits
        trace = sampler.short_fit(model, size, all_samples=True)
        return trace if ran(trace) else None
    good, sampler.too_large, _ = descend(sampler.b0, sampler.too_large, run_at, sampler.pool.wait > 0)
    if good is not None:
        sampler.after_oom.append(good.batch_size)  # the size that ran (_fit_args.runnable)
    if good is None:
        # Not even a batch of 1 ran: none fits (advice_cap is 0), and the failed step
        # says what a batch of 1 would need at least.
        if sampler.prefix is None:   # the failed step was not recorded (see with_failed)
            return None
        failed = StepModel.build(sampler.prefix, None, first=True, epoch=sampler.data.epoch, fresh=False)
        m = sampler.use_model(StepModels([failed]))
        return m if sampler.too_large == 1 else None

    def with_failed(model):
        # The failed step up to its refusal, its blocks lined up with a complete step's
        # (without that second size, on PyTorch, whose blocks carry no batch tag, none
        # of them would shrink with the batch): the retry's first step must fit too.
        # Unless a short run shows it wrong: its first step, which traced the step as
        # the retry's will, completed at a size this model says does not fit. The
        # failed step can have built what the retry finds built (the zoo's embedding
        # model: Adam's two slots of its 12 MiB table, and their initial values, made
        # while 71 MiB of 76 were in use); by it, no size above 300 fitted, where a
        # short run at 658 completed and 823 trained.
        # The failed step is not recorded where it made more events than the trace holds
        # (_recording.TRACE_CAPACITY): keras.applications' NASNetMobile at 254 samples of
        # 32x32 refused in its first step, which traced the function (about 357,000
        # events, when the trace held 262,144); then the runs alone decide.
        if sampler.prefix is None:
            return StepModels([model])
        f = StepModel.build(plain(sampler.prefix), plain(good), first=True, epoch=sampler.data.epoch,
                            fresh=False)
        return StepModels([model, f] if f.fits(good.batch_size, limit()) else [model])
    # One size only: every block that is not batch-shaped is taken as proportional above
    # it, which can only overstate the need; the next size corrects it.
    current = with_failed(build(good))
    completed = [good]
    refused = False
    # Where the descent went below b0 // 2 (a short run was refused there), the size that
    # completed is DESCENT times under one refused, and a model of that one small size
    # takes every block it cannot pair as proportional, naming little more than its size:
    # keras.io's MNIST convnet after an OOM at 320 under 96 MiB (148 trains): 160 refused,
    # 40 completed, and its model named 54, then 89, then 107, where the runs ended (107;
    # in other processes 160 completed at once). There each run goes at least halfway to
    # the smallest size refused. Not where b0 // 2 completed: the size refused is then
    # the failed one, 1.6 times the limit in the zoo's runs, and halfway lies far above it
    # (the zoo's transformer: 376 refused, then 313, and the answer 263 where 291 was).
    halve = sampler.too_large < sampler.b0
    for _ in range(ASCENT_RUNS):
        halfway = (good.batch_size + sampler.too_large) // 2
        if refused:
            size = halfway
        else:
            size = current.largest_fitting(limit(), at_most=sampler.data.n)
            size = min(max(size, halfway) if halve else size, sampler.too_large - 1)
        if size <= good.batch_size:
            break
        trace = sampler.short_fit(model, size, all_samples=True)
        if ran(trace):
            lower, good = good, trace
            current = with_failed(build(good, lower))
            sampler.after_oom.append(trace.batch_size)
            completed.append(good)
        else:
            sampler.too_large = min(sampler.too_large, size)
            refused = True

    def confirm(good):
        # More steps at `good` than its short run's one recorded step (see CONFIRM_STEPS).
        steps = min(CONFIRM_STEPS, sampler.data.n // good.batch_size) if sampler.data.n else CONFIRM_STEPS
        if steps <= 2 and not sampler.data.from_dataset:
            # An epoch of two full batches or fewer: the short run at this size was a whole
            # epoch, and the retry's later epochs are what is left to meet. The zoo's
            # autoencoder (2,048 samples) after an OOM at 1,900: a short run at 1,314 (its
            # batch and the partial one of 734) completed, and the retry at it ran out
            # (1,188 is the most that trains).
            trace = sampler.short_fit(model, good.batch_size, all_samples=True, epochs=CONFIRM_EPOCHS)
            how = f"{CONFIRM_EPOCHS} epochs"
        else:
            trace = sampler.short_fit(model, good.batch_size, all_samples=True, steps=max(steps, 1))
            how = f"a run of {steps} steps"
        if ran(with_unseen_order(trace, sampler.pool)):
            sampler.confirmed = (good.batch_size, how)
            return True
        return False

    # The answer is a size that ran: the model picks where to look, the runs decide.
    # Extrapolated answers ran out in retries near the limit (the zoo's autoencoder:
    # 1233 after its runs, in CI), where peaks move from run to run. A size above the
    # first that completed must also survive CONFIRM_STEPS steps (where an epoch has more
    # than two batches), and lie RUN_SPREAD below every size refused (settle). (The search
    # once stopped at the first size that completed when a confirmation failed: on the
    # zoo's mixed-precision CNN, 1,024 and 1,045 completed a short run and failed their
    # confirmations, 838 was refused, and the answer was 653, 0.80 of 817.)
    by_size = {t.batch_size: t for t in completed}

    def run_at(size):
        trace = sampler.short_fit(model, size, all_samples=True)
        if not ran(trace):
            return False
        by_size[size] = trace
        sampler.after_oom.append(trace.batch_size)
        return True

    answer, sampler.too_large = settle(completed[0].batch_size, [t.batch_size for t in completed[1:]],
                                       sampler.too_large, run_at, lambda size: confirm(by_size[size]))
    good = by_size[answer]
    if sampler.confirmed and sampler.confirmed[0] != good.batch_size:
        sampler.confirmed = None
    sampler.after_oom = [b for b in sampler.after_oom if b <= good.batch_size]
    completed = sorted((t for t in by_size.values() if t.batch_size <= good.batch_size), key=lambda t: t.batch_size)
    current = with_failed(build(good, completed[-2]) if len(completed) > 1 else build(good))
    sampler.cap = good.batch_size
    return sampler.use_model(current)


def descend(b0, too_large, run_at, can_wait):
    """The first short runs after an OOM at `b0`: at b0 // 2, then down by DESCENT to a
    batch of 1 (below `too_large`, the smallest size known refused), until one completes
    (`run_at(size, waits)`: its trace, or None where it was refused). Their requests do
    not wait for frees (_recording.fit_steps); where not even a batch of 1 completes and
    `can_wait` (the retry's requests will wait), the same descent with waits, and every
    run after it waits too. A step's fixed workspaces can meet whatever its batch size:
    TensorFlow's convolution backprop takes 24.6 MB (its 30 MiB working set) at any batch
    of an embedding and two Conv1D over 600 tokens; under 40 MiB two of them met in some
    short runs, every size down to 1 was refused, and the advice named 0 where 8 to 17
    train (waiting, the second waits for the first to free its own). Returns (the trace
    that completed or None, the smallest size refused, whether the runs wait)."""
    sizes, size = [], b0 // 2
    while size > 1:
        sizes.append(size)
        size //= DESCENT
    refused = too_large
    for waits in (False, True) if can_wait else (False,):
        refused = too_large
        for size in sizes + [1]:
            if size >= refused:
                continue
            trace = run_at(size, waits)
            if trace is not None:
                return trace, refused, waits
            refused = size
    return None, refused, bool(can_wait)


def settle(first, pending, too_large, run_at, confirm, runs=None):
    """The answer after the ascent: the largest size confirmed, or `first` (the size whose
    whole short run completed first, known good). `pending`: the sizes above `first` whose
    short run completed, ascending, each to be confirmed (`confirm(size)`: True when its
    longer run completed); `too_large`: the smallest size refused.

    A size is taken only at least RUN_SPREAD below the smallest refused one: within it, a
    completion says as little as a refusal (on the zoo, the ResNet's 304 completed a short
    run and four steps, 306 was refused, and the retry at 304 ran out; 301 is the most
    that trains in two processes of two). The search goes up from the largest size known
    good (first, then each one confirmed): the highest pending size not too near a
    refusal is confirmed; where none is left, a short run halfway to the smallest refused
    (`run_at(size)`: True when it completed; such a size is confirmed in turn), until the
    next size would be too near a refusal or `runs` (default CONFIRM_RUNS) runs are spent.
    Returns (answer, too_large)."""
    pending = sorted(pending)
    known = first

    def ceiling():
        return int(too_large / (1 + RUN_SPREAD))
    for _ in range(CONFIRM_RUNS if runs is None else runs):
        pending = [v for v in pending if known < v <= ceiling()]
        if pending:
            size = pending.pop()
            if confirm(size):
                known, pending = size, []
            else:
                too_large = min(too_large, size)
            continue
        size = min((known + too_large) // 2, ceiling())
        if size <= known:
            break
        if run_at(size):
            pending.append(size)
        else:
            too_large = min(too_large, size)
    return known, too_large


def without_runs(sampler):
    """After a refused step where no short run is made (needs_steps() False: data that no
    run can be made on, such as a generator, a PyDataset or tensors given as x, or steps
    that completed at the failed size whose model says it does not fit): that model, with
    the failed step's beside it up to its refusal (the retry's first step must fit too),
    and the answer at least RUN_SPREAD below the failed size, as the runs' answers are
    (within it a completion says as little as a refusal: a CNN on a PyDataset refused at
    190 was named 183 by the model of its steps at 190, and the retry ran out). None where
    that names no size while a step at the failed size completed within the budget: a
    model of one size takes every block it cannot pair as fixed below that size, and
    cannot show that no size fits (a sparse bag-of-words model refused at 630 was told
    that even a batch of 1 needs 260 MiB of its 224, where 508 trained)."""
    model, sampler.cap = _recorded_model(sampler)
    return model


def _recorded_model(sampler):
    """(without_runs()'s model or None, the cap on the advice it sets), `sampler` left as
    it was."""
    model = sampler.model()
    if model is None:
        return None, sampler.cap
    if sampler.prefix is not None and sampler.template is not None:
        # Its blocks lined up with the run's second size where it has one (an epoch's
        # partial last batch), else taken as one size's.
        other = sampler.other if sampler.other is not None and sampler.other.batch_size != sampler.b0 \
            else sampler.template
        failed = StepModel.build(sampler.prefix, other, first=True, epoch=sampler.data.epoch, fresh=False)
        model = StepModels([model, failed])
    cap = min(sampler.cap, int(sampler.b0 / (1 + RUN_SPREAD)))
    if (sampler.template or sampler.first) is not None and \
            model.largest_fitting(sampler.pool.stats()["bytes_limit"], at_most=min(sampler.too_large - 1, cap)) < 1:
        return None, cap   # (and where the suggestion from it names none: MemGuardCallback's OOM path)
    return model, cap


def needs_steps(sampler):
    """True when the advice after the refused step needs steps of its own (array data,
    or a tf.data dataset to sample them from, and no complete step recorded at the
    failed size, or a model of the steps that completed there that says the size fits:
    the refusal showed it wrong there, and it cannot place the answer); else
    model_after_oom() is the recorded steps' model. The zoo's embedding model at 1,316
    (823 trains): steps completed, the next was refused (12.2 MiB asked with 70.3 of
    76 MiB in use), their model said 1,316 fits, and the answer was 1,315, whose retry
    ran out."""
    if not sampler.data.usable:
        return False
    if sampler.template is None or sampler.data.varying:
        # (A dataset whose batches vary in shape: the steps that completed at the failed
        # size were of other shapes than the one refused, and say nothing of the longest.
        # Sequences of 5 to 855 tokens through padded_batch(120) under 200 MiB: the model of
        # the steps that completed named 104, which ran out; 90 trains.)
        return True
    model = sampler.model()
    if model is None:
        return False
    # Where the model says the failed size does not fit but names no smaller size either
    # (with the failed step beside it: without_runs), it cannot place the answer. A wide
    # MLP (84 MB of weights, Adam's slots and gradients) at 256 under 96 MiB: steps
    # completed, waiting, then one was refused, and the report named nothing, saying that
    # no short run had completed where none had been made.
    return model.fits(sampler.b0, sampler.pool.stats()["bytes_limit"]) or _recorded_model(sampler)[0] is None


def pipeline_extra(sampler):
    """After an OOM on a dataset: its pipeline's buffers that do not grow with the batch,
    as measured in the failed step or as its caches and shuffle buffers hold once filled,
    as one more block at a step's start (short runs on arrays do not meet them;
    _dataset_sample.pipeline_extra), or None."""
    if not sampler.data.from_dataset:
        return None
    dataset = sampler.data.dataset()
    try:
        return _dataset_sample.pipeline_extra(sampler.prefix, dataset)
    finally:
        del dataset
