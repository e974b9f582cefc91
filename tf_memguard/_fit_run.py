"""What one fit() call makes of its run for MemGuardCallback: whether the pool sees its
tensors, the samples, the batch size run and each step's, the StepSampler that records its
steps for the advice (_steps), and the size its epochs proved."""
import warnings

from tf_memguard import _fit_args, _install, _recording
from tf_memguard._steps import StepSampler

_warned = set()  # reasons already said, once per process


def serving(device):
    """False, with one warning per reason and process, when the pool of `device` does not
    see the framework's tensors (_install.not_serving)."""
    reason = _install.not_serving(device)
    if reason is None:
        return True
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn("tf_memguard: " + reason, stacklevel=3)
    return False


def run_of(fit_args, model, pool, params, batch_size=None, advice=True, collective=False, garbage=0):
    """(samples, batch size run, StepSampler or None) of the running fit() of `model` on
    `pool`, called with `fit_args` (_fit_args.fit_arguments()). `params`: the callback's
    Keras params; `batch_size`: the callback's argument, else the fit()'s; `advice`: False
    records no steps; `collective`: a worker of a multi-worker run; `garbage`: the bytes the
    fit()'s build left and the callback collected (_recording.collect_build_garbage)."""
    x, y = fit_args.get("x"), fit_args.get("y")
    # Arrays, or tensors (a tf.SparseTensor, strings): the short runs batch them as fit() does.
    arrays = _fit_args.is_arrays(x) or _fit_args.is_sliceable(x)
    n = _fit_args.training_samples(fit_args)
    # A batch_size above the samples runs them all as one batch: that is the size run
    # (at 4,096 on 300 images the report named nothing, and after an OOM quoted a budget for 4,096).
    run_batch = _fit_args.run_batch_size(batch_size or _fit_args.batch_size(fit_args), n if arrays else None)
    if not advice or not run_batch:
        return n, run_batch, None
    dataset = _fit_args.is_dataset(x)
    sampler = StepSampler(pool, run_batch, n_samples=n, steps_per_epoch=(params or {}).get("steps"),
                          x=x if arrays else None, y=y if arrays else None,
                          own_epochs=fit_args.get("steps_per_epoch") is None,
                          dataset=x if dataset or _fit_args.is_py_dataset(x) else None,
                          validation=_fit_args.validation_arrays(fit_args),
                          partial=_fit_args.dataset_partial_batch(x) if dataset and batch_size is None else None,
                          collective=collective)
    sampler.garbage_per_sample = _recording.build_garbage_rate(model, garbage, run_batch)
    return n, run_batch, sampler


def step_batch(sampler, params, batch, run_batch):
    """The batch size of the fit()'s step `batch`: the epoch's partial last batch, or the
    size run."""
    if sampler and sampler.partial and params and batch == params.get("steps", 0) - 1:
        return sampler.partial
    return run_batch


def proven_size(sampler, monitor, budget, epoch, run_batch):
    """The size run, where its epochs so far (`epoch`: the last one of this fit(), from 0)
    stayed within the budget and prove it fits, else 0. A size that ran its epochs within
    the budget fits, whatever the margins say; but the first epoch's steps did not meet
    Keras' copy of the validation arrays, made at its evaluation and held through every
    later epoch: until a second epoch ran with it, the model (which adds it) decides.
    keras.io's timeseries autoencoder (Conv1D / Conv1DTranspose, validation_split=0.1) at
    128 under 48 MiB: epoch 1 peaked at 47.6 MiB, the warning said "A batch size of up to
    128 (now 128) fits" where the model put 128 at 48.8, and epoch 2 ran out, 0.3 MiB
    short."""
    proven = epoch >= 1 or not sampler.data.validation_copies
    return run_batch if monitor.peak() <= budget and proven else 0
