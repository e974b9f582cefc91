"""The out-of-memory error that explains itself: the request, the budget, what holds the
memory (by kind), the largest free block, and what would fit (_advice)."""
from tf_memguard import _advice
from tf_memguard._units import format_bytes

# What each kind of block is, as a user should read it (TFMG_KIND_*, cc/tfmg/c_api.h).
KIND_NAMES = {
    "kernel": "the step's tensors",
    "input": "numpy and Python values made into tensors (Keras' copy of the data among them)",
    "data": "tf.data's buffers (elements, batches, shuffle and prefetch)",
    "constant": "constants (the graph's, and constant folding's)",
    "xla": "XLA's buffers (jit_compile)",
    "copy": "copies of tensors",
    "tensor": "tensors made outside kernels",
    "raw": "runtime buffers",
    "other": "tensors",
}


def holders(by_kind, over_by_kind, limit=4):
    """'48.0 MiB numpy and Python values..., 12.3 MiB the step's tensors': the largest
    holders first (at most `limit`), those granted over the budget marked."""
    parts = sorted(((v, k) for k, v in by_kind.items() if v), reverse=True)[:limit]
    out = []
    for v, k in parts:
        over = over_by_kind.get(k, 0)
        text = f"{format_bytes(v)} {KIND_NAMES.get(k, k)}"
        if over:
            text += f" ({format_bytes(over)} of it granted over the budget: it cannot be refused)"
        out.append(text)
    return ", ".join(out)


def largest_free(refusal):
    """The largest free block at a refusal, as the pool names it. Where the pool backs its
    regions on demand (host and CUDA), they are address space, twice the budget: a free
    block can be larger than the budget, and what of it the budget can back decides."""
    largest, allocatable = refusal["largest_free_block_bytes"], refusal["largest_allocatable_bytes"]
    limit, reserved = refusal.get("bytes_limit", 0), refusal.get("bytes_reserved", 0)
    req = refusal.get("requested_bytes", 0)
    if limit and reserved and allocatable >= req and limit - reserved < req:
        # The pool's bound counts the budget not in use; a request also needs the granules
        # under it backed, and what is not in use can lie in granules that blocks in use
        # share, which cannot be backed again. (keras.io's OCR model under 384 MiB: 243 KiB
        # refused beside "largest free block 768 KiB within the budget".)
        return (f"less than {format_bytes(req)} once backed "
                f"({format_bytes(max(0, limit - refusal['bytes_in_use']))} of the budget is not in use but lies in "
                f"granules that blocks in use share, and {format_bytes(max(0, limit - reserved))} is left to back "
                "new granules)")
    if allocatable < largest:
        return f"{format_bytes(allocatable)} within the budget"
    return format_bytes(largest)


def refused(device, refusal):
    """What was refused and what held the budget: the request, the budget in use, the
    largest free block, any wait, and the holders by kind."""
    req = refusal["requested_bytes"]
    outside = refusal["passthrough_bytes_in_use"]
    in_use = refusal["bytes_in_use"] - outside
    text = (f"{device}: cannot allocate {format_bytes(req)} ({req} bytes): {format_bytes(in_use)} of the "
            f"{format_bytes(refusal['bytes_limit'])} budget in use, largest free block {largest_free(refusal)}")
    waited = refusal.get("waited_ns", 0)
    text += (f", after waiting {waited / 1e9:.2f} s for blocks the kernels on other threads free." if waited > 0
             else ".")
    held = holders(refusal.get("bytes_in_use_by_kind", {}), refusal.get("overshoot_in_use_by_kind", {}))
    if held:
        text += f" In use: {held}."
    return text


def explain(device, refusal, suggestion=None, running=None, deferred=False, dataset=False, granted=None):
    """The note for an out-of-memory error: what was refused, what held the budget, and
    what to do (`suggestion`: an _advice.Suggestion, or None when none could be made;
    `deferred`: the suggestion is worked out when the report is read; `dataset`: from a
    sample of a tf.data dataset's batches; `granted`: {kind: bytes} of the run's requests
    that cannot be refused granted over the budget before the refusal)."""
    text = refused(device, refusal) + granted_before(granted)
    if deferred:
        now = f" (now {running})" if running else ""
        return text + (f" Reduce the batch size{now}: after the except block and gc.collect(), "
                       "tf_memguard.report().suggested_batch_size is the largest that fits (or 0, with the budget "
                       "that would fit in the report), worked out when read with short runs of fit() at "
                       "smaller sizes" + (" on the dataset's first batches, taken as arrays" if dataset else "") +
                       "; until then this error holds the failed fit()'s data, which the retry will "
                       "not meet. Retry after the except block.")
    if suggestion is not None:
        text += " " + _advice.advice_sentence(suggestion, running)
    elif running:
        text += f" Reduce the batch size (now {running}) or pass a larger max_bytes to tf_memguard.install()."
    else:
        text += " Reduce the batch size or pass a larger max_bytes to tf_memguard.install()."
    # While it is handled, an exception holds the failed fit()'s frames, and with them its
    # copy of the data: a retry inside the except block meets two copies.
    return text + RETRY


def granted_over(stats, start):
    """{kind: bytes}: how far a run's requests that cannot be refused passed the budget at
    once, at most, from the pool's `stats` now and at the run's `start`: what of each kind
    the run was granted over it, at most the pool's peak of such bytes in use at once."""
    was = start["overshoot_bytes_by_kind"]
    return {k: min(v - was.get(k, 0), stats["peak_overshoot_bytes"])
            for k, v in stats["overshoot_bytes_by_kind"].items() if v > was.get(k, 0)}


def granted_before(granted):
    """' Before it, XLA's buffers ... were granted 15.5 MiB over the budget ...': what of
    the run's requests that cannot be refused passed the budget before the refusal, which
    the memory in use at the refusal does not show (a grouped Conv1D network, which Keras
    compiles with XLA on the CPU, refused at 120 under 160 MiB: 16.2 MB of XLA's buffers
    had been granted over the budget earlier in that step). '' where none was."""
    parts = [f"{KIND_NAMES.get(k, k)}, up to {format_bytes(v)} over it at once" for k, v in
             sorted((granted or {}).items()) if v > 0]
    if not parts:
        return ""
    return " Before it, requests that cannot be refused were granted over the budget in this run: " + \
        "; ".join(parts) + "."


RETRY = " Retry after the except block, and gc.collect() first: until then this error holds the failed fit()'s data."


def evaluation(device, refusal, call, argument, running, size, method, by_callback=False):
    """The note for an out-of-memory error in an evaluation step (`call`: "fit()'s
    validation", "evaluate()", "predict()", or with `by_callback`, such a call a callback made
    inside fit(), which the error ends; `argument`, the batch size argument that sets its
    size, `running`, or for a dataset, which fixes its own batches, how it was batched,
    e.g. "batch"): what was refused, and `size`, the largest batch size of that step that
    fits (0: none was found; None: none could be looked for), by `method`."""
    text = refused(device, refusal)
    whose = f"that of {call}" if by_callback else f"{call}'s"
    if argument.startswith("."):
        at = f"on the dataset's batches{f' of {running}' if running else ''}"
        text += f" The step that ran out was {whose}, {at}. Rebuild the dataset with a smaller {argument}() ({method})."
    else:
        text += f" The step that ran out was {whose}, at {argument}={running}."
        if size:
            text += f" Pass {argument}={size} (or less): {method}."
        elif size == 0:
            text += f" No smaller size was found that fits ({method}): pass a larger max_bytes to tf_memguard.install()."
        else:
            text += f" Pass a smaller {argument} ({method})."
    which = "fit()" if by_callback else call.split("'")[0]   # fit(), evaluate(), predict()
    return text + (" Retry after the except block, and gc.collect() first: until then this error holds the "
                   f"failed {which}'s data.")


def not_in_the_pool(device, framework_name):
    return (f"{device}: {framework_name} ran out of memory, but not in tf_memguard's pool (no request was "
            "refused); the budget is not what stopped it.")


def constant_refused(device, refusal, suggestion=None, running=None):
    """For TensorFlow's InvalidArgumentError 'Cannot parse tensor from proto' after the
    pool refused a constant (the step's graph holds one too large for the budget)."""
    return ("TensorFlow could not build the step: a constant of " + format_bytes(refusal["requested_bytes"]) +
            " did not fit the budget (TensorFlow reports that as 'Cannot parse tensor from proto'; such "
            "constants often come from constant folding of a tensor shaped by the batch size). " +
            explain(device, refusal, suggestion, running))


def overshoot_stop(device, kind, granted, peak, budget, step, suggestion=None, running=None):
    """A step whose requests that cannot be refused (XLA's buffers, oneDNN's kernels) were
    granted over the budget: `granted` bytes of them in the run, the step's account
    peaking at `peak`. The run stops after it."""
    why = {"xla": "XLA's buffers (jit_compile=True, and grouped convolutions, which Keras compiles with XLA on "
                  "the CPU) cannot be refused: TensorFlow loses the model's variables "
                  "when one is (seen with TensorFlow 2.21)",
           "kernel": "oneDNN kernels crash when an allocation is refused (a TensorFlow bug; start Python with "
                     "TF_ENABLE_ONEDNN_OPTS=0 for a hard budget)"}.get(kind, "those requests cannot be refused")
    if peak > budget:
        how = (f"needed {format_bytes(peak - budget)} more than the {format_bytes(budget)} budget (its memory in "
               f"use peaked at {format_bytes(peak)})")
    else:
        # Within the budget in all, but a block too large for any free block of the pool.
        how = (f"needed blocks larger than any free block of the {format_bytes(budget)} budget's pool "
               f"({format_bytes(granted)} in all)")
    text = (f"{device}: step {step} {how}, granted over the budget because {why}; the run stopped after that "
            "step, with the model intact.")
    if suggestion is not None:
        text += " " + _advice.advice_sentence(suggestion, running)
    return text
