"""A size below the running one, after a run stopped for a step granted over the budget
(XLA's buffers, oneDNN's kernels: requests that cannot be refused), as short runs show
it: the size the memory model names is run for one step, and a smaller one is named
where that step too passed the budget (MemGuardCallback._stop_for_overshoot)."""
import dataclasses
import gc

# Short runs (one step each) at most: the size named, then smaller ones where it was
# granted over too (as _confirm.CONFIRM_RUNS above the running size).
CHECK_RUNS = 3


def checked_below(cb, suggestion, kind):
    """`suggestion`, below the running size after a step granted over the budget, as
    short runs show it: one step at it, and where that step too was granted over the
    budget, a smaller size: the model with that step added, at most where the line
    through the peaks of the steps over reaches the budget (CHECK_RUNS at most).
    A model of steps at the running size and half of it, scaled far below them, misses
    what the compiled step holds whatever its size: the README's CNN with
    jit_compile=True under 48 MiB, stopped at 512, was named 42, whose step peaked at
    57.7 MiB with the failed run's copy of the arrays live. The answer is a size whose step ran within the budget, or the last one
    named, its method saying so."""
    from tf_memguard._memory_model import StepModel, StepModels
    sampler, model = cb._sampler, cb._sampler.model()
    base = sampler.template or sampler.first
    size, tried = suggestion.batch_size, []
    if size < 1 or size >= sampler.b0 or not sampler.data.usable or \
            not sampler.data.sample_dataset(sampler.b0):
        return suggestion   # nothing to check, or no arrays nor a dataset to sample them from
    # The step's peak as the retry would meet it: the retry holds Keras' copy of the
    # arrays, which the short run may not (a numpy array aligned as TensorFlow wants is
    # taken without a copy: on the CNN at 42 the step ran within the budget in one
    # process and its retry went 9.7 MiB over, the copy being 12 MiB). The short run's
    # own copy is what it holds of input beyond what was live before it; the failed
    # fit()'s copy, live while this runs, is counted in full, for a retry that finds it
    # not yet collected (one such went 245 KiB over at 27 in CI, where the model had
    # named 27 after three steps granted over).
    copies = sum(sampler.data.copy_sizes())
    points = []   # (size, its step's peak as the retry would meet it) of the steps over
    for _ in range(CHECK_RUNS):
        if size < 1 or (sampler.data.n or 0) < size:
            break
        before = cb._pool.stats()["overshoots_by_kind"][kind]
        gc.collect()
        held = cb._pool.stats()["bytes_in_use_by_kind"]["input"]
        trace = sampler.short_fit(cb.model, size, all_samples=True, steps=1)
        if trace is None and not tried:
            return suggestion   # no short run could be made: not checked
        peak = 0
        if trace is not None and trace.observed_peak:
            own = min(max(trace.start_bytes("input") - held, 0), copies)
            peak = int(trace.observed_peak) - own + copies
        over = cb._pool.stats()["overshoots_by_kind"][kind] > before or peak > cb._budget or \
            (trace is not None and trace.granted_over(kind))
        if trace is not None and trace.complete and not over:
            method = suggestion.method + (f"; steps at {', '.join(map(str, tried))} were granted over the budget"
                                          if tried else "") + f"; a step at {size} ran within the budget"
            return dataclasses.replace(suggestion, batch_size=int(size), method=method)
        tried.append(size)
        if trace is not None and base is not None:
            model = StepModels([model, StepModel.build(trace, base, epoch=sampler.data.epoch, fresh=False)])
        nxt = min(model.largest_fitting(cb._budget, at_most=size - 1), size - 1)
        if peak > cb._budget:
            points.append((size, peak))
            nxt = min(nxt, below_budget(points, cb._budget))
        size = nxt
    size = max(size, 0)
    method = suggestion.method + f"; steps at {', '.join(map(str, tried))} were granted over the budget" + \
        (", and this one was not run" if size else ", and no smaller size fits by the model")
    one = max(model.budget_for(1), cb._budget + (1 << 20)) if size == 0 else 0
    return dataclasses.replace(suggestion, batch_size=int(size), method=method, one_sample_bytes=int(one))


def below_budget(points, budget):
    """The size whose step's peak reaches `budget` on the line through the last two of
    `points` ((size, peak) of steps over it), or, from one, in proportion to the size (a
    step's fixed part makes the proportion too large: on the README's CNN with
    jit_compile=True under 48 MiB the model with each step added had named one less each
    time, 42, 41, 40, 39; the peaks of steps at 42 and 26, 60.4 and 49.9 MB, lie on a line
    of 0.66 MB a sample that the steps at 19 and 15 met to within 0.1 MB)."""
    (s1, p1), (s2, p2) = points[-2] if len(points) > 1 else (0, 0), points[-1]
    if len(points) > 1 and s1 != s2 and (p1 - p2) * (s1 - s2) > 0:
        slope = (p1 - p2) / (s1 - s2)
        return max(int(s2 - (p2 - budget) / slope), 0)
    return s2 * budget // p2
