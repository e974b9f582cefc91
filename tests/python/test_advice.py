"""Advice that is right: the batch size MemGuardCallback suggests after one epoch fits the
budget, and is at least 85% of the largest that fits, found by bisection over real
fit() runs (each in a fresh process; a size fits when it trains in REPEATS of them).

"Fits" means trains for EPOCHS epochs. Every epoch starts a new tf.data iterator, and the
first steps of each peak differently from run to run (the test MLP at 3,000 samples:
39.5-40.3 MiB in three epochs of one run, against a 40 MiB budget), so a one-epoch run
that fits is one lucky draw: bisection over one-epoch runs found 3,482-3,591 for the MLP,
where two-epoch runs at 3,300-3,500 ran out in six of six (benchmarks/NOTES.md).
A batch size is advice for training, which takes more than one epoch."""
import os

import pytest

from tfproc import HARD, run

pytestmark = pytest.mark.tf
HERE = os.path.dirname(os.path.abspath(__file__))

EPOCHS = 2
# Runs (fresh processes) a size must train in to count as fitting, in the bisection. Near
# its limit the MLP trains in some runs and not others (under 40 MiB: 2,900 in four of
# four, 3,000 in two of four, 3,100 in one of four), so a bisection over single runs
# finds the luckiest draw: a CI run found 3,244 and failed the 85% test on it. The
# largest size that fits is the largest a user can count on.
REPEATS = 2
# (model, budget MiB, batch size of the advised run: its peak near the budget)
CASES = [("mlp", 40, 2048), ("cnn", 80, 76), ("lstm", 48, 128)]

FIT = """
import sys; sys.path.insert(0, {here!r})
import tensorflow as tf, tf_memguard
from advice_models import build
x, y, make_model = build({kind!r})
tf_memguard.install(max_bytes={budget} << 20)  # before the model is built, as the README has it
m = make_model()
cb = tf_memguard.MemGuardCallback(verbose=0)
try:
    m.fit(x, y, batch_size={batch}, epochs={epochs}, verbose=0, callbacks=[cb])
    emit(fits=True, suggested=tf_memguard.report().suggested_batch_size,
         peak=tf_memguard.report().peak_bytes)
except tf.errors.ResourceExhaustedError:
    emit(fits=False)
"""


def fits(kind, budget, batch):
    r = run(FIT.format(here=HERE, kind=kind, budget=budget, batch=batch, epochs=EPOCHS), env=HARD)
    assert r.returncode == 0, r
    return r.data


def fits_every_time(kind, budget, batch):
    return all(fits(kind, budget, batch)["fits"] for _ in range(REPEATS))


def bisect_max(kind, budget, lo, hi):
    """Largest batch size in [lo, hi) that fits REPEATS times, to within 3%."""
    while hi - lo > max(1, lo // 33):
        mid = (lo + hi) // 2
        if fits_every_time(kind, budget, mid):
            lo = mid
        else:
            hi = mid
    return lo


def suggestion(kind, budget, batch):
    advised = fits(kind, budget, batch)
    assert advised["fits"], "the advised run itself must fit"
    assert advised["suggested"], "a suggestion after one epoch"
    return advised["suggested"]


@pytest.mark.parametrize("kind,budget,batch", CASES)
def test_suggested_batch_size_trains_without_running_out(kind, budget, batch):
    size = suggestion(kind, budget, batch)
    assert fits(kind, budget, size)["fits"], f"suggested {size} ran out of memory"


@pytest.mark.parametrize("kind,budget,batch", CASES)
def test_suggested_batch_size_is_at_least_85_percent_of_the_largest(kind, budget, batch):
    size = suggestion(kind, budget, batch)
    best = bisect_max(kind, budget, size, 4 * max(size, batch))
    print(f"{kind}: suggested {size}, largest that fits {best} ({size / best:.2f})")
    assert size >= 0.85 * best, f"suggested {size}, largest that fits {best}"


TRIAL = """
import sys; sys.path.insert(0, {here!r})
import keras, tf_memguard
from advice_models import build
from tf_memguard import _advisor, _install
x, y, make_model = build("cnn")
m = make_model()
tf_memguard.install(max_bytes=400 << 20)
pool = _install.device_pool("CPU:0")
peaks = []
class Steps(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        pool.reset_peak()
    def on_train_batch_end(self, batch, logs=None):
        peaks.append(pool.stats()["window_peak_bytes_in_use"])
m.fit(x, y, batch_size=100, epochs=2, verbose=0, callbacks=[Steps()])
# fit() has let its copy of the arrays go: a copy's bytes stand for it (the trials'
# own copy may be aliased instead, TensorFlow decides; their peaks leave it out).
snapshot = _advisor._Snapshot(m)
trials = _advisor.FitTrials(m, x, y, pool)
fit_like = trials(100).peak_bytes + _advisor.copy_bytes(x, y)
snapshot.restore()
trials.close()
lone = _advisor.trial_step(m, x, y, 100, pool).peak_bytes + _advisor.copy_bytes(x, y)
snapshot.restore()
emit(fit=max(peaks), fit_like=fit_like, lone=lone)
"""


def test_a_trial_needs_what_a_step_of_fit_needs():
    # The CNN at 100 samples (a partial last batch): fit()'s steps peaked at 76.8 MiB; a
    # trial through fit()'s kind of pipeline, with a train function traced afresh, at
    # the same; a lone train_on_batch step, with a copy of the data beside it, 3.5 MiB
    # under (what led the advice to sizes that ran out).
    d = run(TRIAL.format(here=HERE), env=HARD).data
    assert d is not None
    assert abs(d["fit_like"] - d["fit"]) <= 0.01 * d["fit"], d
    assert d["lone"] < d["fit"] - (1 << 20), d
