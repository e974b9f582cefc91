"""Requests that wait for what other threads free (cc/tfmg/free_wait.h), through the
Pool, install() and a Keras fit() whose kernels' order decides whether it fits."""
import re
import threading
import time

import pytest

from tf_memguard import _core
from tfproc import HARD, TIMESERIES_AUTOENCODER, run

MiB = 1 << 20


def held_pool(wait):
    """A 4 MiB pool whose requests wait up to `wait` s without a free, 3 MiB of it held:
    (pool, the held block)."""
    p = _core.Pool(max_bytes=4 * MiB)
    p.set_wait(wait)
    return p, p.allocate(3 * MiB)


def test_a_waiting_request_is_served_by_another_threads_free():
    p, held = held_pool(2.0)
    threading.Timer(0.05, p.free, args=(held,)).start()
    t0 = time.monotonic()
    got = p.allocate(2 * MiB, wait=True)
    assert 0.04 <= time.monotonic() - t0 < 1.5
    s = p.stats()
    assert (s["num_waits"], s["num_waits_served"], s["num_refusals"]) == (1, 1, 0)
    assert s["longest_wait_ns"] >= 40e6
    p.free(got)
    p.close()


def test_a_wait_without_frees_is_refused_with_how_long_it_waited_and_the_next_at_once():
    p, held = held_pool(0.1)
    t0 = time.monotonic()
    with pytest.raises(_core.OutOfBudgetError, match=r"waited 0\.1\d s for blocks other threads free"):
        p.allocate(2 * MiB, wait=True)
    assert time.monotonic() - t0 >= 0.09
    assert p.last_refusal()["waited_ns"] >= 90e6
    t0 = time.monotonic()
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB, wait=True)  # the step is failing: no second wait
    assert time.monotonic() - t0 < 0.05
    assert p.last_refusal()["waited_ns"] == 0
    assert p.stats()["num_refusals"] == 2 and p.stats()["num_waits"] == 1
    p.free(held)
    p.close()


def test_once_the_failed_step_is_over_a_request_waits_again_at_once():
    # The episode after a wait that gave up refuses requests at once until none was
    # refused for the wait time: a retry begun within it ran its steps without waits (the
    # timeseries autoencoder's retry right after its OOM, 3 of 3 out of memory).
    # end_failed_wait() (MemGuardCallback calls it once the failed call has returned) ends it.
    p, held = held_pool(0.3)
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB, wait=True)
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB, wait=True)   # the episode: at once
    assert p.stats()["num_waits"] == 1
    p.end_failed_wait()
    threading.Timer(0.05, p.free, args=(held,)).start()
    got = p.allocate(2 * MiB, wait=True)   # waits, and the free serves it
    s = p.stats()
    assert (s["num_waits"], s["num_waits_served"], s["num_refusals"]) == (2, 1, 2)
    p.free(got)
    p.close()


def test_a_request_larger_than_the_whole_budget_is_refused_without_waiting():
    # No free can make room for it: it waited the full wait before (a GradientTape step's
    # 112 MiB convolution under 64 MiB, "after waiting 1.00 s").
    p, held = held_pool(5.0)
    with pytest.raises(_core.OutOfBudgetError) as e:
        p.allocate(5 * MiB, wait=True)
    assert "waited" not in str(e.value)
    assert p.last_refusal()["waited_ns"] == 0 and p.stats()["num_waits"] == 0
    # One that would fit once others free still waits, and is served.
    threading.Timer(0.05, p.free, args=(held,)).start()
    got = p.allocate(4 * MiB, wait=True)
    assert p.stats()["num_waits_served"] == 1
    p.free(got)
    p.close()


def test_without_wait_or_with_must_succeed_a_request_never_waits():
    p, held = held_pool(5.0)
    t0 = time.monotonic()
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB)
    over = p.allocate(8 * MiB, must_succeed=True)
    assert time.monotonic() - t0 < 1.0
    assert p.stats()["num_waits"] == 0 and p.stats()["num_overshoots"] == 1
    with pytest.raises(ValueError, match="wait=True with must_succeed=True"):
        p.allocate(1, must_succeed=True, wait=True)
    for bad in (-1, float("nan"), 7200):
        with pytest.raises(ValueError, match="wait=.*: must be a number of seconds"):
            p.set_wait(bad)
    p.free(over)
    p.free(held)
    p.close()


def test_install_takes_wait_and_rejects_bad_values():
    r = run("""
        import tf_memguard
        cfg = tf_memguard.install(max_bytes="256MiB")
        default = (cfg.wait, tf_memguard.device_pool().wait)
        cfg = tf_memguard.install(max_bytes="256MiB", wait=0)
        off = (cfg.wait, tf_memguard.device_pool().wait)
        bad = []
        for value in (-1, "1s", True, 1e9):
            try:
                tf_memguard.install(max_bytes="256MiB", wait=value)
            except ValueError as e:
                bad.append(str(e))
        emit(default=default, off=off, bad=bad, limit=tf_memguard.stats()["bytes_limit"],
             documented=tf_memguard._install.DEFAULT_WAIT)
    """)
    assert r.returncode == 0, r
    assert r.data["default"] == [r.data["documented"]] * 2
    assert r.data["off"] == [0.0, 0.0]
    assert len(r.data["bad"]) == 4 and all("must be a number of seconds" in m for m in r.data["bad"])
    assert r.data["limit"] == 256 * MiB  # a bad wait changed nothing


# The zoo's autoencoder under 240 MiB at 1,250 samples: with requests refused at once its
# first step runs out in every process (0 of 5 trained, the kernels' order), with the
# default wait it trains, its waiting requests served (benchmarks/NOTES.md, "Waiting for
# frees").
AUTOENCODER = """
    import sys
    sys.path.insert(0, "benchmarks")
    import tf_memguard
    from zoo import build
    tf_memguard.install(max_bytes=240 << 20, wait={wait})
    import tensorflow as tf
    x, y, make = build("autoencoder")
    m = make()
    try:
        m.fit(x, y, batch_size=1250, epochs=2, verbose=0)
        trained = True
    except tf.errors.ResourceExhaustedError:
        trained = False
    s = tf_memguard.stats()
    emit(trained=trained, waits=s["num_waits"], served=s["num_waits_served"], refusals=s["num_refusals"],
         peak_reserved=s["peak_bytes_reserved"], limit=s["bytes_limit"])
"""


@pytest.mark.tf
def test_a_step_that_fits_only_in_another_order_trains_when_its_requests_wait():
    waited = run(AUTOENCODER.format(wait="None"))
    assert waited.returncode == 0, waited
    assert waited.data["trained"], waited.data
    assert waited.data["served"] >= 1 and waited.data["refusals"] == 0
    assert waited.data["peak_reserved"] <= waited.data["limit"]
    at_once = run(AUTOENCODER.format(wait="0"))
    assert at_once.returncode == 0, at_once
    assert not at_once.data["trained"] and at_once.data["waits"] == 0
    assert at_once.data["peak_reserved"] <= at_once.data["limit"]


def test_the_oom_note_says_how_long_the_refused_request_waited():
    from tf_memguard import _oom
    p, held = held_pool(0.05)
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB, wait=True)
    note = _oom.explain("CPU:0", p.last_refusal(), running=64)
    assert re.search(r"cannot allocate 2\.00 MiB .* largest free block .*, after waiting 0\.0\d s for blocks the "
                     r"kernels on other threads free\. In use: .* Reduce the batch size \(now 64\)", note), note
    with pytest.raises(_core.OutOfBudgetError):
        p.allocate(2 * MiB)  # not waiting: the note says nothing of a wait
    assert "waiting" not in _oom.explain("CPU:0", p.last_refusal())
    p.free(held)
    p.close()


@pytest.mark.tf
def test_a_users_own_loop_of_smaller_sizes_after_an_oom_gets_its_waits_back_without_the_callback():
    # keras.io's timeseries anomaly-detection autoencoder under 48 MiB (its convolutions take
    # 23-26 MB workspaces whatever the batch, two of which meet unless one waits), fit()
    # tried at 160, 128, 112, 100, 90 and 80 in one loop, no MemGuardCallback: after the
    # first OOM the pool's failed episode refused every request that did not fit at once,
    # each refusal extending it, and every size down to 80 ran out within 0.2 s with no
    # request waiting (3 of 3 processes), where 112-128 train. The episode now ends once
    # the bytes in use fall to what the refused request would have fitted beside.
    r = run("""
        import gc
        import numpy as np
        import tf_memguard
        tf_memguard.install(max_bytes="48MiB")
        import keras, tensorflow as tf
    """, TIMESERIES_AUTOENCODER, """
        tried = []
        for size in (160, 128, 112, 100, 90, 80):
            before = tf_memguard.stats()["num_waits"]
            try:
                m.fit(xs, xs, batch_size=size, epochs=2, validation_split=0.1, verbose=0)
                tried.append([size, "trained", tf_memguard.stats()["num_waits"] - before])
                break
            except tf.errors.ResourceExhaustedError:
                tried.append([size, "ran out", tf_memguard.stats()["num_waits"] - before])
            gc.collect()
        emit(tried=tried, peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, env=HARD)
    assert r.returncode == 0, r
    tried = r.data["tried"]
    assert tried[-1][1] == "trained" and tried[-1][2] > 0, tried   # it trained, its requests waiting
    assert tried[-1][0] >= 100, tried                              # 112-128 train; the loop stopped early
    assert r.data["peak_reserved"] <= 48 << 20, r.data
