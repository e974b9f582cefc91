"""MemGuardCallback, the report, the OOM explanation and find_batch_size, as a user runs them."""
import os
import re

import pytest

from tfproc import HARD, TIMESERIES_AUTOENCODER, run

pytestmark = pytest.mark.tf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
BENCH = os.path.join(ROOT, "benchmarks")

SETUP = f"""
import sys, json
sys.path.insert(0, {EXAMPLES!r})
import numpy as np, tensorflow as tf, keras, tf_memguard
from _data import pattern_images, small_cnn
x, y = pattern_images(1024)
def make():
    keras.utils.set_random_seed(0)
    m = small_cnn()
    m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m
"""


def test_peaks_land_in_history_and_csvlogger_and_state_resets_between_fits(tmp_path):
    csv = tmp_path / "log.csv"
    png = tmp_path / "memory.png"
    r = run(SETUP, f"""
        tf_memguard.install(max_bytes="160MiB")
        m = make()
        cb = tf_memguard.MemGuardCallback()
        h = m.fit(x, y, batch_size=64, epochs=2, verbose=2,
                  callbacks=[cb, keras.callbacks.CSVLogger({str(csv)!r})])
        first = len(cb.report.epochs)
        h2 = m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[cb])
        rep = tf_memguard.report()
        rep.save_plot({str(png)!r})
        path = {str(tmp_path / "report.json")!r}
        rep.to_json(path)
        back = tf_memguard.Report.from_json(path)
        emit(keys=sorted(h.history), peaks=h.history["memguard_peak_mib"],
             fractions=h.history["memguard_budget_fraction"], first=first, second=len(rep.epochs),
             text=str(rep), json=json.loads(rep.to_json()), model_back=back.model() is not None,
             suggested=rep.suggested_batch_size)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert "memguard_peak_mib" in d["keys"] and "memguard_budget_fraction" in d["keys"]
    assert all(p > 1 for p in d["peaks"])
    assert all(0 < f <= 1 for f in d["fractions"])
    assert abs(d["fractions"][0] - d["peaks"][0] / 160) < 1e-3
    assert d["first"] == 2 and d["second"] == 1  # per-run state reset in on_train_begin
    header = open(csv).readline().strip().split(",")
    assert "memguard_peak_mib" in header and "memguard_budget_fraction" in header
    # Keras' progress line shows the peak readably (it once read 100981760.0000).
    assert re.search(r"memguard_peak_mib: \d+\.\d{4}", r.stdout), r.stdout[-2000:]
    assert "epoch 1: peak " in r.stdout and "of 160 MiB (" in r.stdout
    assert "tf_memguard memory report (CPU:0, budget 160 MiB)" in d["text"]
    assert "leak check:" in d["text"] and "refused" in d["text"]
    assert "batch size that fits the budget: " in d["text"] and d["suggested"] > 64
    assert d["json"]["budget_bytes"] == 160 << 20 and len(d["json"]["epochs"]) == 1
    assert d["model_back"] is True   # the memory model travels with the report (what-if)
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_silent_with_verbose_zero_and_works_without_install():
    r = run(SETUP, """
        m = make()
        h = m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback()])
        emit(keys=sorted(h.history), peak=h.history["memguard_peak_mib"][0])
    """)
    assert r.returncode == 0, r
    assert "memguard_peak_mib" in r.data["keys"] and "memguard_budget_fraction" not in r.data["keys"]
    assert r.data["peak"] > 1
    assert "epoch 1" not in r.stdout and "memory report" not in r.stdout


def test_bad_arguments_say_which_and_numpy_integers_are_taken():
    r = run("""
        import numpy as np, tf_memguard
        errors = []
        for kw in ({"warn_at": 0}, {"warn_at": True}, {"batch_size": -3}, {"batch_size": True},
                   {"verbose": "loud"}, {"leak_epochs": -1}, {"device": "TPU:0"}, {"advice": "yes"}):
            try:
                tf_memguard.MemGuardCallback(**kw)
            except ValueError as e:
                errors.append(str(e))
        ok = tf_memguard.MemGuardCallback(batch_size=np.int64(32)).batch_size
        emit(errors=errors, ok=ok)
    """)
    assert r.returncode == 0, r
    e = r.data["errors"]
    assert len(e) == 8, e
    assert e[0].startswith("warn_at=0:") and e[1].startswith("warn_at=True:") and e[2].startswith("batch_size=-3:")
    assert e[3].startswith("batch_size=True:") and e[4].startswith("verbose='loud':")
    assert e[5].startswith("leak_epochs=-1:") and "TPU" in e[6] and e[7].startswith("advice='yes':")
    assert r.data["ok"] == 32


OOM_RUN = None


def oom_run():
    global OOM_RUN
    if OOM_RUN is None:
        OOM_RUN = _oom_run()
    return OOM_RUN


def _oom_run():
    return run(SETUP, """
        import gc
        tf_memguard.install(max_bytes="128MiB")
        x, y = pattern_images(4096)   # as examples/oom_recovery.py
        m = make()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        peak_reserved = []
        try:
            m.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[cb])
            notes = None
        except tf.errors.ResourceExhaustedError as e:
            notes = "\\n".join(getattr(e, "__notes__", [])) or str(e)
            del e
        usable = all(np.isfinite(w).all() for w in m.get_weights())
        gc.collect()
        size = tf_memguard.report().suggested_batch_size
        advice, method = tf_memguard.report().advice, tf_memguard.report().suggestion_method
        oom = tf_memguard.report().oom
        try:
            retry = m.fit(x, y, batch_size=size, epochs=2, verbose=0, callbacks=[cb]).history["loss"][-1]
        except tf.errors.ResourceExhaustedError:
            retry = None
        s = tf_memguard.stats()
        emit(notes=notes, usable=usable, size=size, advice=advice, method=method, oom=oom, retry_loss=retry,
             limit=s["bytes_limit"],
             peak_reserved=s["peak_bytes_reserved"])
    """, env=HARD)


def test_oom_is_explained_and_reported_and_the_process_goes_on():
    r = oom_run()
    assert r.returncode == 0, r
    d = r.data
    assert d["notes"] is not None
    for part in ("tf_memguard: CPU:0: cannot allocate", "of the 128 MiB budget in use", "largest free block",
                 "In use: ", "the step's tensors", "Keras' copy of the data", "Reduce the batch size (now 1024)",
                 "tf_memguard.report().suggested_batch_size", "Retry after the except block"):
        assert part in d["notes"], d["notes"]
    # Read after the except block, the report has the size, and how it was found.
    assert 0 < d["size"] < 1024 and "Reduce the batch size to" in d["advice"], d
    assert "short fit() runs after the out-of-memory error" in d["method"], d
    # The largest free block it names is one the budget could back (regions are address
    # space, twice the budget).
    from tf_memguard._units import parse_bytes
    largest = re.search(r"largest free block (?:less than )?([\d.]+ [KMG]iB)", d["notes"]).group(1)
    assert parse_bytes(largest.replace(" ", ""), 0) <= 128 << 20, d["notes"]
    assert d["oom"] and "cannot allocate" in d["oom"]
    assert d["usable"] is True
    assert 1 <= d["size"] < 1024
    assert d["limit"] == 128 << 20


def test_a_retry_at_the_suggested_batch_size_trains_and_the_budget_was_never_raised():
    r = oom_run()
    assert r.returncode == 0, r
    assert r.data["retry_loss"] is not None, r.data
    # The advice's own steps ran under the budget too: at no moment did the pool hold more.
    assert r.data["peak_reserved"] <= 128 << 20


def test_after_an_oom_far_over_the_limit_the_suggestion_is_as_good_as_near_it():
    # At 4096 (about 18 times what fits under 128 MiB) the short runs after the OOM go down
    # from 2048 by DESCENT to a size that completes, then up by the model: the answer is
    # to be as large as after the OOM at 1024 (oom_run), not a size extrapolated from a
    # batch of 1, and a retry at it trains.
    near = oom_run()
    assert near.returncode == 0 and near.data["size"], near
    r = run(SETUP, """
        import gc
        tf_memguard.install(max_bytes="128MiB")
        x, y = pattern_images(4096)
        m = make()
        try:
            m.fit(x, y, batch_size=4096, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome = "trained"
        except tf.errors.ResourceExhaustedError as e:
            outcome = type(e).__name__
            del e
        gc.collect()
        size, method = tf_memguard.report().suggested_batch_size, tf_memguard.report().suggestion_method
        retry = m.fit(x, y, batch_size=size, epochs=1, verbose=0,
                      callbacks=[tf_memguard.MemGuardCallback(verbose=0)]).history["loss"][-1]
        emit(outcome=outcome, size=size, method=method, retry=retry,
             peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, env=HARD, timeout=900)
    assert r.returncode == 0, r
    d = r.data
    assert d["outcome"] == "ResourceExhaustedError", d
    assert d["size"] >= 0.85 * near.data["size"], (d, near.data["size"])
    assert d["retry"] > 0 and d["peak_reserved"] <= 128 << 20, d


def test_no_batch_size_fits_when_the_fixed_part_fills_the_budget():
    # Conv2DBackpropFilter takes a fixed workspace of about 20 MB whatever the batch size:
    # under 24 MiB nothing fits, and the note says which budget would.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="24MiB")
        m = make()
        try:
            m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            notes = None
        except tf.errors.ResourceExhaustedError as e:
            notes = "\\n".join(getattr(e, "__notes__", []))
        emit(notes=notes, suggested=tf_memguard.report().suggested_batch_size, text=str(tf_memguard.report()))
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["notes"] and "tf_memguard.report().suggested_batch_size" in d["notes"], d
    assert "No batch size fits the 24.0 MiB budget" in d["text"], (d["suggested"], d["text"])
    need = re.search(r"Pass max_bytes of at least ([\d.]+ [KMG]iB)", d["text"])
    assert need, d["text"]
    from tf_memguard._units import parse_bytes
    assert parse_bytes(need.group(1).replace(" ", ""), 0) > 24 << 20
    assert d["suggested"] == 0 and "no batch size fits the budget" in d["text"]


def test_an_interrupted_fit_leaves_nothing_behind_for_the_next():
    # Ctrl-C inside fit(): Keras calls no on_train_end. The next fit(), with a new callback,
    # explains its own out-of-memory error (its batch size, not the interrupted run's).
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        from tf_memguard import _core
        x, y = pattern_images(4096)
        m = make()
        class CtrlC(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    raise KeyboardInterrupt
        try:
            m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0), CtrlC()])
        except KeyboardInterrupt:
            pass
        profiling = _core.profile_batch()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        try:
            m.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[cb])
            notes = ""
        except tf.errors.ResourceExhaustedError as e:
            notes = "\\n".join(getattr(e, "__notes__", []))
        wrapped = getattr(m.train_function, "_tf_memguard_original", None) is not None
        emit(notes=notes, report=cb.report is not None, profiling=profiling, wrapped=wrapped)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["profiling"] == 0, d                   # nothing left switched on by the interrupted run
    assert "(now 1024)" in d["notes"] and "(now 64)" not in d["notes"], d["notes"]
    assert d["notes"].count("tf_memguard:") == 1, d["notes"]   # one note, from the new callback
    assert d["report"] is True and d["wrapped"] is False


def test_a_disabled_plugin_is_said_once_and_nothing_is_logged():
    r = run(SETUP, """
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = make()
            h1 = m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback()])
            h2 = m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback()])
        said = [str(w.message) for w in caught if "tf_memguard" in str(w.message)]
        emit(said=said, keys=sorted(h1.history) + sorted(h2.history))
    """, env={"TF_MEMGUARD_DISABLE": "1"})
    assert r.returncode == 0, r
    assert len(r.data["said"]) == 1 and "TF_MEMGUARD_DISABLE=1" in r.data["said"][0], r.data
    assert not any(k.startswith("memguard") for k in r.data["keys"])


def test_xla_over_the_budget_stops_the_run_after_the_step_with_the_model_intact():
    r = run(SETUP, """
        tf_memguard.install(max_bytes="48MiB")
        m = make()
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
        try:
            m.fit(x, y, batch_size=512, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome, message = "trained", ""
        except tf.errors.ResourceExhaustedError as e:
            outcome, message = type(e).__name__, str(e)
        s = tf_memguard.stats()
        p = m.predict(x[:8], verbose=0)
        finite = bool(np.isfinite(p).all() and all(np.isfinite(w).all() for w in m.get_weights()))
        steps = int(m.optimizer.iterations.numpy())
        size = tf_memguard.report().suggested_batch_size
        method = tf_memguard.report().suggestion_method
        # The size the stop names: its steps must fit, XLA's buffers included.
        over = s["overshoots_by_kind"]["xla"]
        try:
            m.fit(x, y, batch_size=size, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            retry = "trained"
        except tf.errors.ResourceExhaustedError as e:
            retry = str(e)[:400]
        emit(outcome=outcome, message=message, xla=s["overshoot_bytes_by_kind"]["xla"], finite=finite, steps=steps,
             size=size, method=method, retry=retry, more=tf_memguard.stats()["overshoots_by_kind"]["xla"] - over)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    if d["xla"] == 0:
        pytest.skip("XLA's buffers fitted the budget on this machine")
    assert d["outcome"] == "BudgetExceededError", d
    assert "XLA's buffers (jit_compile=True" in d["message"] and "cannot be refused" in d["message"], d["message"]
    assert "the run stopped after that step, with the model intact" in d["message"]
    assert d["finite"] is True and d["steps"] == 1, d   # one step, then stopped
    # The size named (in the message and the report) trains with nothing granted over the
    # budget. Before: "a batch size of up to 1024 (now 512) fits" and no size in the report
    # (keras.applications' ConvNeXtTiny was named 200, then 149, where XLA's buffers passed
    # the budget). Now a model of steps at 512 and 256 (what the first step made and kept
    # live at the start, ONE_DRAW_SPREAD free) names a size, and a step at it must run
    # within the budget, else a smaller one is named (42 here, its step granted over with
    # the failed run's copy of the arrays live; then 26, on the line through the peaks,
    # which ran). The size named was run: before, the model with each step added named
    # 42, 33, 29 and then 27, not run, which went 245 KiB over in CI's retry.
    assert d["size"] and f"to {d['size']} (now 512)" in d["message"], d
    assert d["method"].endswith(f"a step at {d['size']} ran within the budget"), d["method"]
    assert d["retry"] == "trained" and d["more"] == 0, d


def test_the_report_read_after_the_except_block_collects_the_failed_runs_garbage_first():
    # The suggestion after an OOM is worked out when first read, by short runs that must
    # not meet the failed fit()'s data, garbage in a reference cycle until a collection.
    # Read without gc.collect() (here 8 MiB in a cycle, automatic collection off), it was
    # worked out beside it, with a warning that it may be smaller than what fits.
    r = run(SETUP, """
        import gc, warnings
        tf_memguard.install(max_bytes="64MiB")
        m = make()
        gc.collect()
        gc.disable()
        try:
            m.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            first = "trained"
        except tf.errors.ResourceExhaustedError:
            first = "oom"
        class Holder: pass
        h = Holder(); h.me = h; h.t = tf.ones((2 << 20,))   # 8 MiB in a cycle
        del h
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            size = tf_memguard.report().suggested_batch_size
        gc.enable()
        emit(first=first, size=size, warned=[str(w.message)[:120] for w in caught if "is read while" in str(w.message)])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["first"] == "oom" and d["size"], d
    assert d["warned"] == [], d


def test_after_an_oom_whose_failed_step_made_the_optimizers_slots_the_report_neither_warns_nor_names_no_steps():
    # Keras builds Adam's slots of zeros sharing one buffer until the first update writes
    # them: a first fit() that runs out in its first step has made them, and they stay
    # (the model's own state). Read after the except block and gc.collect(), the report
    # warned that the failed fit()'s data was still held (the 19 MiB of slots), and, no
    # short run fitting, named its method "the memory model of steps at " (no sizes), and
    # said "about" of budgets that are what the step held up to its refusal (a retry in
    # the same process under the 98.8 MiB it named for 32 ran out; 100.5 MiB were used).
    r = run("""
        import gc, re, warnings
        import numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="64MiB")
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048), keras.layers.Dense(2048),
                              keras.layers.Dense(10)])   # 24 MiB of weights, 48 of Adam's slots
        m.compile("adam", "mse")
        x, y = np.zeros((640, 512), "float32"), np.zeros((640, 10), "float32")
        def read():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rep = tf_memguard.report()
                size = rep.suggested_batch_size
            return rep, size, [str(w.message)[:100] for w in caught if "is read while" in str(w.message)]
        try:
            m.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            first = "trained"
        except tf.errors.ResourceExhaustedError:
            first = "oom"
        gc.collect()
        rep, size, warned = read()
        need = re.search(r"or more than ([0-9.]+) MiB for the batch size of 32", rep.advice)
        try:   # what it names is less than the step needs, no more: the budget 90% of it does not fit
            tf_memguard.install(max_bytes=int(float(need.group(1)) * 2**20 * 0.9))
            m.fit(x, y, batch_size=32, epochs=2, verbose=0)
            retry = "trained"
        except tf.errors.ResourceExhaustedError:
            retry = "oom"
        gc.collect()
        # Inside the except block the error holds the failed fit()'s frames: a warning.
        del m
        gc.collect()
        tf_memguard.install(max_bytes="64MiB")
        # Dense(4096)'s output at 4,096 rows is 64 MiB, the whole budget: it cannot fit beside the
        # 8 MiB of weights, whatever order the kernels run in and however long a request waits
        # (with Dense(2048), 32 MiB, a dW-before-dx order with a wait trained once in CI).
        m2 = keras.Sequential([keras.Input((512,)), keras.layers.Dense(4096), keras.layers.Dense(10)])
        m2.compile("adam", "mse")
        big = np.ones((4096, 512), "float32")   # Keras' copy of it: 8 MiB
        try:
            m2.fit(big, np.zeros((4096, 10), "float32"), batch_size=4096, epochs=1, verbose=0,
                   callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            inside = None
        except tf.errors.ResourceExhaustedError as e:
            inside = read()[2]
        emit(first=first, size=size, method=rep.suggestion_method, advice=rep.advice, warned=warned, retry=retry,
             inside=inside)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["first"] == "oom" and d["size"] == 0, d
    assert d["warned"] == [], d
    assert d["method"].startswith("the failed step at 32 up to its refusal"), d["method"]
    assert "even a batch of 1 needs more than" in d["advice"] and "up to its refusal" in d["advice"], d["advice"]
    assert d["retry"] == "oom", d
    assert d["inside"] is not None and len(d["inside"]) == 1, d


def test_after_an_oom_where_the_recorded_steps_name_no_size_short_runs_decide():
    # A wide MLP's steps completed at 256 (they can, waiting, at the edge of the budget),
    # then one was refused. The model of the steps that completed said 256 does not fit,
    # and named no smaller size either (its need is nearly all weights, slots and
    # gradients), and the report said "no short run of fit() at a smaller size completed"
    # where none had been made, naming no budget. Here the budget is lowered after the
    # second step (install() again) to draw that case in every process.
    r = run("""
        import gc, numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="256MiB")
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048), keras.layers.Dense(2048),
                              keras.layers.Dense(10)])   # 24 MiB of weights, 48 of Adam's slots
        m.compile("adam", "mse")
        x, y = np.zeros((2560, 512), "float32"), np.zeros((2560, 10), "float32")
        class Lower(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 1:
                    tf_memguard.install(max_bytes="84MiB")
        try:
            m.fit(x, y, batch_size=256, epochs=1, verbose=0,
                  callbacks=[tf_memguard.MemGuardCallback(verbose=0), Lower()])
            first, notes = "trained", ""
        except tf.errors.ResourceExhaustedError as e:
            first, notes = "oom", "\\n".join(getattr(e, "__notes__", []))
        gc.collect()
        rep = tf_memguard.report()
        emit(first=first, notes=notes, size=rep.suggested_batch_size, method=rep.suggestion_method,
             advice=rep.advice)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["first"] == "oom", d
    assert "worked out when read with short runs" in d["notes"], d["notes"]
    assert d["size"] == 0, d
    assert d["method"].startswith("the failed step at 256 up to its refusal"), d["method"]
    assert "even a batch of 1 needs more than" in d["advice"] and "Pass max_bytes of at least" in d["advice"], d


def test_at_a_batch_of_one_the_second_size_is_two_and_the_advice_names_a_useful_size():
    # With no size below 1, the run had one size, every block no batch tag marks was taken
    # as possibly proportional, and a CNN at 1 under 96 MiB was advised 2 (121 trains).
    r = run("""
        import numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="96MiB")
        L = keras.layers
        rng = np.random.default_rng(0)
        x = rng.random((256, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, 256)
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3, activation="relu"),
                              L.Conv2D(64, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        m.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        rep = tf_memguard.report()
        size = rep.suggested_batch_size
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0)
            retry = "trained"
        except tf.errors.ResourceExhaustedError:
            retry = "ran out"
        emit(size=size, method=rep.suggestion_method, retry=retry)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["method"].startswith("the memory model of steps at 1 and 2"), d
    assert d["size"] >= 32 and d["retry"] == "trained", d


def test_a_batch_size_above_the_samples_is_taken_as_the_one_batch_fit_runs():
    # fit(batch_size=4096) on 300 samples runs one batch of 300: the report named nothing
    # (no step was of 4,096), and after an OOM quoted the budget for 4,096.
    r = run("""
        import gc, numpy as np, tensorflow as tf, keras, tf_memguard
        L = keras.layers
        rng = np.random.default_rng(0)
        x = rng.random((300, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, 300)
        def make():
            keras.utils.set_random_seed(0)
            m = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3, activation="relu"),
                                  L.Conv2D(64, 3, activation="relu"), L.GlobalAveragePooling2D(), L.Dense(10)])
            m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            return m
        tf_memguard.install(max_bytes="256MiB")
        make().fit(x, y, batch_size=4096, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        fits = tf_memguard.report()
        tf_memguard.install(max_bytes="64MiB")
        m = make()
        try:
            m.fit(x, y, batch_size=4096, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        except tf.errors.ResourceExhaustedError:
            pass
        gc.collect()
        oom = tf_memguard.report()
        emit(size=fits.suggested_batch_size, method=fits.suggestion_method, oom_size=oom.suggested_batch_size,
             oom_advice=oom.advice)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["size"] == 300 and d["method"].startswith("the memory model of steps at 300"), d
    assert 0 < d["oom_size"] < 300 and "(now 300)" in d["oom_advice"] and "for 300)" in d["oom_advice"], d


def test_xla_over_the_budget_on_a_dataset_names_a_size_that_trains():
    # Stopped after its first step on a tf.data dataset, the run had no arrays for the step
    # at half the size, and the model of one size took XLA's buffers as fixed: "even a
    # batch of 1 needs about 354 MiB", where 27 trains. The dataset's first batches are now
    # sampled for that step, and the size named is run by a step of its own.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="48MiB")
        m = make()
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
        def data(b):
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=0).batch(b).prefetch(2)
        ds = data(512)
        try:
            m.fit(ds, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome = "trained"
        except tf.errors.ResourceExhaustedError as e:
            outcome = type(e).__name__
        rep = tf_memguard.report()
        size, method = rep.suggested_batch_size, rep.suggestion_method
        over = tf_memguard.stats()["overshoots_by_kind"]["xla"]
        retry = None
        if size:
            try:
                m.fit(data(size), epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
                retry = "trained"
            except tf.errors.ResourceExhaustedError as e:
                retry = str(e)[:300]
        emit(outcome=outcome, size=size, method=method, retry=retry,
             more=tf_memguard.stats()["overshoots_by_kind"]["xla"] - over)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    if d["outcome"] == "trained":
        pytest.skip("XLA's buffers fitted the budget on this machine")
    assert d["outcome"] == "BudgetExceededError", d
    assert d["size"] and d["method"].endswith(f"a step at {d['size']} ran within the budget"), d
    assert d["retry"] == "trained" and d["more"] == 0, d


def test_a_retry_given_the_callback_does_not_meet_the_failed_runs_garbage():
    # The failed fit()'s data stays in the pool until its frames, a reference cycle, are
    # collected; a retry that found it beside its own went over the budget (the test
    # above, in CI). A fit() given MemGuardCallback after a failure collects first: here
    # 8 MiB in a cycle (automatic collection off, as when no allocation triggers it) is
    # gone at the retry's start, and a run that followed no failure leaves such garbage
    # to Python. (Asked of the garbage itself, by a weak reference: the bytes in use at a
    # fit()'s start hold Keras' copy of the arrays in some processes and not in others,
    # as numpy's buffer is aligned for TensorFlow to adopt or not; the test's first form,
    # by the bytes, failed so in CI.)
    r = run(SETUP, """
        import gc, weakref
        tf_memguard.install(max_bytes="64MiB")
        m = make()
        class Probe(keras.callbacks.Callback):
            def __init__(self, ref):
                super().__init__()
                self.ref = ref
            def on_train_begin(self, logs=None):
                self.alive = self.ref() is not None
        def garbage():
            class Holder: pass
            h = Holder(); h.me = h; h.t = tf.ones((2 << 20,))   # 8 MiB in a cycle
            ref = weakref.ref(h)
            del h
            return ref
        def fit(size, ref=None):
            p = Probe(ref or (lambda: None))
            try:
                m.fit(x, y, batch_size=size, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0), p])
                return "trained", p.alive
            except tf.errors.ResourceExhaustedError:
                return "oom", p.alive
        gc.collect()
        fit(8)
        gc.disable()
        first = fit(1024)
        gc.collect()
        base = tf_memguard.stats()["bytes_in_use"]
        ref = garbage()
        held = tf_memguard.stats()["bytes_in_use"]
        retry = fit(8, ref)
        gc.collect()
        ref = garbage()
        plain = fit(8, ref)
        gc.enable()
        emit(first=first[0], base=base, held=held, retry=retry, plain=plain)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["first"] == "oom" and d["held"] - d["base"] >= 8 << 20, d
    assert d["retry"] == ["trained", False], d   # collected at its start
    assert d["plain"] == ["trained", True], d    # no failure: left to Python


def test_a_constant_too_large_for_the_budget_is_an_explained_out_of_memory_error():
    # Batch norm at a static batch size: constant folding makes a zeros constant of the
    # activation's shape (170 MB at 384 samples), larger than the budget. The pool refuses
    # it (TensorFlow reports 'Cannot parse tensor from proto'); the callback makes it an
    # out-of-memory error that says so, and nothing stays in use.
    r = run("""
        import gc, numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="160MiB")
        L = keras.layers
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((48, 48, 3)), L.Conv2D(48, 3, padding="same"), L.BatchNormalization(),
                              L.ReLU(), L.MaxPooling2D(4), L.Flatten(), L.Dense(10)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.random.rand(1536, 48, 48, 3).astype("float32"); y = np.random.randint(0, 10, 1536)
        before = tf_memguard.stats()["bytes_in_use"]
        try:
            m.fit(x, y, batch_size=384, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome, message = "trained", ""
        except tf.errors.ResourceExhaustedError as e:
            outcome, message = type(e).__name__, str(e)
            del e
        gc.collect()
        s = tf_memguard.stats()
        emit(outcome=outcome, message=message, before=before, after=s["bytes_in_use"],
             peak=s["peak_bytes_in_use"], over=s["overshoot_bytes_by_kind"]["constant"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["outcome"] == "BudgetExceededError", d
    assert "a constant of 162 MiB did not fit the budget" in d["message"], d["message"]
    assert d["over"] == 0 and d["peak"] <= 160 << 20
    assert abs(d["after"] - d["before"]) <= 1 << 20, d


def test_an_oom_at_a_static_batch_size_leaves_no_folded_constants_behind():
    # A dataset batched with drop_remainder=True has a static batch size, and Grappler folds
    # batch-shaped zeros into constants that the traced train function holds (116 MB on the
    # zoo's resnet at 888 under 420 MiB). The OOM must not leave them taking the retry's
    # memory: the callback drops the trace, and a retry at a smaller size trains.
    r = run(f"""
        import gc, sys
        sys.path.insert(0, {BENCH!r})
        from zoo import build
        import tf_memguard
        tf_memguard.install(max_bytes="420MiB")
        import tensorflow as tf
        x, y, make = build("resnet")
        m = make()
        pool = tf_memguard.device_pool()
        before = pool.stats()["bytes_in_use"]
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(888, drop_remainder=True)
        try:
            m.fit(ds, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome = "trained"
        except tf.errors.ResourceExhaustedError as e:
            outcome = type(e).__name__
            del e
        del ds
        gc.collect()
        s = pool.stats()
        after, constants = s["bytes_in_use"], s["bytes_in_use_by_kind"]["constant"]
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True)
        h = m.fit(ds, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        emit(outcome=outcome, before=before, after=after, constants=constants, retry=h.history["loss"][-1],
             peak_reserved=pool.stats()["peak_bytes_reserved"])
    """, env=HARD, timeout=900)
    assert r.returncode == 0, r
    d = r.data
    assert d["outcome"] == "ResourceExhaustedError", d
    assert d["after"] - d["before"] <= 1 << 20 and d["constants"] <= 1 << 20, d
    assert d["retry"] > 0 and d["peak_reserved"] <= 420 << 20, d


def test_find_batch_size_restores_the_model_exactly_and_its_answer_trains():
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        m.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)   # optimizer built
        w0 = [w.copy() for w in m.get_weights()]
        o0 = [v.numpy().copy() for v in m.optimizer.variables]
        ran = []
        fit = m.fit
        def counted(*a, **k):   # the training steps find_batch_size runs
            ran.append(k.get("steps_per_epoch"))
            return fit(*a, **k)
        m.fit = counted
        size = tf_memguard.find_batch_size(m, x, y)
        m.fit = fit
        same_w = all(np.array_equal(a, b) for a, b in zip(w0, m.get_weights()))
        same_o = all(np.array_equal(a, v.numpy()) for a, v in zip(o0, m.optimizer.variables))
        cb = tf_memguard.MemGuardCallback(verbose=0, advice=False)
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0, callbacks=[cb])
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        from tf_memguard import _find
        emit(size=size, same_w=same_w, same_o=same_o, trained=trained, copy=x.nbytes + y.nbytes, ran=ran,
             fraction=cb.report.peak_bytes / (128 << 20) if trained else None,
             steps=[[t.batch_size, t.complete] if t is not None else None for t in _find.last_steps])
    """, env=HARD)
    assert r.returncode == 0, r
    assert r.data["same_w"] is True and r.data["same_o"] is True
    # At most its default 4 steps, one at each size (the first size's step is recorded as
    # it traces: four sizes, not three).
    assert r.data["ran"] and all(k == 1 for k in r.data["ran"]) and sum(r.data["ran"]) <= 4, r.data
    if not r.data["trained"]:
        # A known failure, kept visible: from steps at 32 and about 76, the answer is 370 in
        # most runs and 466-467 in some, which run out (2026-12-01; benchmarks/NOTES.md,
        # "find_batch_size flips between 370 and 466"). Issue 14 stays open for it.
        pytest.xfail(f"find_batch_size named {r.data['size']}, which ran out of memory")
    last = r.data["steps"][-1]
    if r.data["fraction"] + r.data["copy"] / (128 << 20) < 0.85 and (last is None or not last[1]):
        # A known failure, kept visible: the model of the steps at 32 and about 73 put the
        # limit at 518 in some runs (the step at 73's kernel order moves with the threads'
        # timing; 2 of 4 runs with another process on the cores), the step there was
        # refused with the steps spent, and the answer is the last size that completed
        # (benchmarks/NOTES.md, "find_batch_size under CPU contention"). Issue 14 stays open.
        pytest.xfail(f"find_batch_size's last step was refused and it named {r.data['size']}: {r.data['steps']}")
    # The largest size that fits: its run uses most of the budget, counting Keras' 12 MiB
    # copy of the arrays, which is in the pool in some runs and not in others.
    used = r.data["fraction"] + r.data["copy"] / (128 << 20)
    if used < 0.85:
        # A known miss, kept visible: with 1/7 of the step's growth kept for orders one step
        # does not show (ONE_DRAW_SPREAD), an unlucky draw of the steps' orders names a size
        # that trains but uses less: 274, 0.79 of the budget, in CI on 2026-12-05 (eighteenth
        # session), where six local runs named 348-358 (0.91-1.01). Issue 14 stays open for
        # find_batch_size's 0.85.
        pytest.xfail(f"find_batch_size named {r.data['size']}, which trained using {used:.2f} of the budget")
    assert used >= 0.85, r.data


def test_find_batch_size_keeps_room_for_the_orders_that_later_steps_of_a_fit_meet():
    # keras.io's "Text classification with Transformer" (its custom TokenAndPositionEmbedding
    # and TransformerBlock layers) under 512 MiB. Each size find_batch_size tries is the
    # first step of a short fit(), and that step peaked at 461-466 MiB at 324 where 30 of
    # the 36 steps of two epochs after it peaked at 515: find named 324 (its step there
    # completed), and two epochs at 324 ran out in every process (benchmarks/NOTES.md, "The
    # first step of a fit() is not its steps").
    r = run("""
        import numpy as np, tensorflow as tf, keras, tf_memguard
        from keras import layers, ops
        tf_memguard.install(max_bytes="512MiB")

        class TransformerBlock(layers.Layer):
            def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
                super().__init__()
                self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
                self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
                self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
                self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
                self.dropout1 = layers.Dropout(rate)
                self.dropout2 = layers.Dropout(rate)

            def call(self, inputs, training=False):
                attn_output = self.dropout1(self.att(inputs, inputs), training=training)
                out1 = self.layernorm1(inputs + attn_output)
                ffn_output = self.dropout2(self.ffn(out1), training=training)
                return self.layernorm2(out1 + ffn_output)

        class TokenAndPositionEmbedding(layers.Layer):
            def __init__(self, maxlen, vocab_size, embed_dim):
                super().__init__()
                self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
                self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

            def call(self, x):
                return self.token_emb(x) + self.pos_emb(ops.arange(start=0, stop=ops.shape(x)[-1], step=1))

        rng = np.random.default_rng(15)
        x = rng.integers(1, 20000, (3000, 200)).astype("int32")
        y = rng.integers(0, 2, 3000).astype("int32")
        inputs = layers.Input(shape=(200,))
        h = TransformerBlock(32, 2, 32)(TokenAndPositionEmbedding(200, 20000, 32)(inputs))
        h = layers.Dropout(0.1)(layers.GlobalAveragePooling1D()(h))
        h = layers.Dropout(0.1)(layers.Dense(20, activation="relu")(h))
        m = keras.Model(inputs, layers.Dense(2, activation="softmax")(h))
        m.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        size = tf_memguard.find_batch_size(m, x, y)
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(size=size, trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    assert r.data["trained"] is True, r.data
    # About 1.57 MiB a sample in the steps after the first: the limit lies near 320.
    assert r.data["size"] >= 240, r.data


def test_find_batch_size_halves_its_default_start_when_that_does_not_fit():
    # keras.io's timeseries transformer (250 steps, 4 blocks) under 512 MiB trains at 17
    # and not at 20: find_batch_size raised "not even a batch of 32 fits" instead of
    # answering. Here an embedding over 2,048 tokens a sample, about 3.5 MiB a sample in
    # its step, under 96 MiB: 21 trains and 22 runs out (2026-12-05), so 32 never fits
    # (the small CNN's limit at such budgets moved with where Keras' copy of the images
    # went, and 32 fitted in one run of two).
    r = run("""
        import numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="96MiB")
        rng = np.random.default_rng(0)
        x, y = rng.integers(0, 1000, (512, 2048)).astype("int32"), rng.integers(0, 2, 512).astype("int32")
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((2048,), dtype="int32"), keras.layers.Embedding(1000, 256),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        w0 = [w.copy() for w in m.get_weights()]
        try:
            tf_memguard.find_batch_size(m, x, y, start=32)
            explicit = None
        except tf_memguard.OutOfBudgetError as e:
            explicit = str(e)
        size = tf_memguard.find_batch_size(m, x, y)
        same_w = all(np.array_equal(a, b) for a, b in zip(w0, m.get_weights()))
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(explicit=explicit, size=size, same_w=same_w, trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    # A start the user chose is not second-guessed: it raises, saying what to do.
    assert d["explicit"] and d["explicit"].startswith("find_batch_size: not even a batch of 32 fits the 96.0 MiB") \
        and "or a smaller start" in d["explicit"], d
    assert d["same_w"] is True, d
    assert d["trained"] is True, f"find_batch_size's {d['size']} ran out of memory"
    # Found from 16 upwards, not left at a power of two: 19 in three runs of three.
    assert 16 < d["size"] < 32, d


def test_find_batch_size_after_a_refusal_looks_at_most_halfway_and_does_not_stay_at_a_small_size():
    # A model whose step takes a 100 MiB workspace only above 200 samples: the steps at
    # small sizes never show it, so the model names a size above 200 and it is refused.
    # The model's own correction then named 244 (refused again) and find_batch_size
    # answered 85, the last size that completed; the zoo's embedding model was answered
    # 32 that way where 823 trains. After a refusal the next size is at most halfway
    # from the largest that completed to the smallest refused. And the shortfall the
    # refusal showed is the current model's: when a later step completed above 200 (208,
    # 214: the workspace in its step), the first model's shortfall kept besides counted
    # the workspace twice and the answer was 97-102, under sizes that completed (CI, and
    # 3 of 7 runs here, on 2026-12-07).
    r = run(SETUP, """
        from tf_memguard import _find
        tf_memguard.install(max_bytes="160MiB")
        class Workspace(keras.layers.Layer):
            def call(self, h):
                def taken():
                    w = tf.random.uniform([(100 << 20) // 4])
                    return h + tf.reduce_mean(w)
                return tf.cond(tf.shape(h)[0] > 200, taken, lambda: h)
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Conv2D(32, 3, activation="relu"), Workspace(),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        size = tf_memguard.find_batch_size(m, x, y, steps=5)
        tried = [[t.batch_size, bool(t.complete)] for t in _find.last_steps if t is not None]
        try:
            m.fit(x, y, batch_size=size, epochs=1, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(size=size, tried=tried, trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert any(not ok for _, ok in d["tried"]), d   # the workspace was met: a size was refused
    good, refused = 0, None
    for size, ok in d["tried"]:
        if refused is not None:
            assert size <= (good + refused) // 2, d   # at most halfway after a refusal
        if ok:
            good = max(good, size)
        else:
            refused = size if refused is None else min(refused, size)
    assert d["trained"] is True, d
    # Above the largest size that completed before the first refusal, where the old code
    # stayed (85; 179 with RUN_SPREAD kept for orders not met, 126-179 with find's
    # ONE_DRAW_SPREAD: the shortfall the refusal showed is taken per sample).
    first_refused = next(i for i, (_, ok) in enumerate(d["tried"]) if not ok)
    assert max(size for size, _ in d["tried"][:first_refused]) < d["size"] <= 200, d


def test_steps_per_execution_gets_find_batch_size_and_the_advice_after_an_oom():
    # keras.io's MNIST convnet compiled with steps_per_execution=8 under 96 MiB (184
    # trains, with no request waiting): Keras calls the batch hooks once per execution of 8
    # steps, and the short runs' recorded second step never began. find_batch_size raised
    # "not even a batch of 1 fits", and after an OOM at 320 the suggestion was 0. The
    # short runs now run one step per execution (the model's own is put back), with room
    # for the batch the loop of steps fetches beside each step. (The OOM is at 640: 320
    # trained in one process of several, its requests waiting.)
    r = run("""
        import gc, numpy as np, tensorflow as tf, keras, tf_memguard
        from keras import layers
        tf_memguard.install(max_bytes="96MiB")
        rng = np.random.default_rng(7)
        x = rng.random((6000, 28, 28, 1), dtype=np.float32)
        y = np.eye(10, dtype="float32")[rng.integers(0, 10, 6000)]
        keras.utils.set_random_seed(0)
        m = keras.Sequential([
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(32, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(64, kernel_size=(3, 3), activation="relu"), layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(), layers.Dropout(0.5), layers.Dense(10, activation="softmax")])
        m.compile(loss="categorical_crossentropy", optimizer="adam", metrics=["accuracy"], steps_per_execution=8)
        size = tf_memguard.find_batch_size(m, x, y)
        spe = m.steps_per_execution
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        own_function = m.train_function
        try:
            m.fit(x, y, batch_size=640, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            oom = False
        except tf.errors.ResourceExhaustedError:
            oom = True
        gc.collect()
        after = tf_memguard.report().suggested_batch_size
        try:
            m.fit(x, y, batch_size=after, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            retry = True
        except tf.errors.ResourceExhaustedError:
            retry = False
        emit(size=size, spe=spe, trained=trained, oom=oom, after=after, retry=retry,
             spe_after=m.steps_per_execution, same_function=m.train_function is own_function)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["spe"] == 8 and d["spe_after"] == 8 and d["same_function"], d  # the model's own put back
    assert d["trained"] is True, f"find_batch_size's {d['size']} ran out of memory"
    assert d["oom"] is True, d
    assert d["retry"] is True, f"the suggestion after the OOM, {d['after']}, ran out of memory"
    # find_batch_size named 175-176 (2026-12-05); 184 trains without a request waiting.
    assert d["size"] >= 150, d
    assert d["after"] >= 100, d


CONV3D = """
import numpy as np, tensorflow as tf, keras, tf_memguard
from keras import layers
tf_memguard.install(max_bytes="512MiB")
rng = np.random.default_rng(10)
x = rng.random((256, 32, 32, 16, 1), dtype=np.float32)
y = rng.integers(0, 2, 256).astype("float32")
keras.utils.set_random_seed(0)
inputs = keras.Input((32, 32, 16, 1))
h = layers.Conv3D(filters=32, kernel_size=3, activation="relu", padding="same")(inputs)
h = layers.MaxPool3D(pool_size=2)(h)
h = layers.BatchNormalization()(h)
h = layers.Conv3D(filters=64, kernel_size=3, activation="relu", padding="same")(h)
h = layers.MaxPool3D(pool_size=2)(h)
h = layers.BatchNormalization()(h)
h = layers.GlobalAveragePooling3D()(h)
h = layers.Dense(units=128, activation="relu")(h)
h = layers.Dropout(0.3)(h)
m = keras.Model(inputs, layers.Dense(units=1, activation="sigmoid")(h))
m.compile(loss="binary_crossentropy", optimizer=keras.optimizers.Adam(1e-4), metrics=["acc"])
"""


def test_a_suggestion_above_the_running_size_trains():
    # keras.io's 3D CNN (shrunk to 32x32x16 volumes) under 512 MiB at 14: the model of its
    # steps at 14 and 4 named 85, which ran out at once. TensorFlow's CPU Conv3D backprop
    # takes a fixed 290 MiB scratch buffer (on this machine's cache size) only from 16
    # samples on (conv_grad_ops_3d.cc, kMaxTempAllocationOverhead), which no step below
    # showed. A size above the running one is now named only once a step at it completed.
    r = run(CONV3D, """
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(x, y, batch_size=14, epochs=2, verbose=0, callbacks=[cb])
        rep = tf_memguard.report()
        size, method = rep.suggested_batch_size, rep.suggestion_method
        # The what-if from the report's model, at the run's own budget.
        emit(size=size, method=method, what_if=rep.model().largest_fitting(512 << 20, at_most=256))
    """, env=HARD)
    assert r.returncode == 0, r
    size = r.data["size"]
    assert size >= 14, r.data  # the running size trained
    refused = re.search(r"short runs at (\d+)", r.data["method"])
    if refused:
        # What the refusals showed goes with the report's model: the what-if from it named
        # 85 again, the size refused (as a pandas MLP's report named 7,714 for 96 MiB where
        # its run had been refused at 3,628 under 48 MiB; 7,714 ran out).
        assert r.data["what_if"] < int(refused.group(1)), r.data
    fit = run(CONV3D, f"""
        try:
            m.fit(x, y, batch_size={size}, epochs=2, verbose=0)
            emit(trained=True)
        except tf.errors.ResourceExhaustedError:
            emit(trained=False)
    """, env=HARD)
    assert fit.returncode == 0, fit
    assert fit.data["trained"] is True, f"the suggestion {size} ran out of memory: {r.data['method']}"


def test_a_failed_step_too_long_to_record_still_gets_a_size_that_trains():
    # keras.applications' NASNetMobile at 254 samples of 32x32 under 256 MiB was refused in
    # its first step, which traced the function in about 357,000 events, more than the
    # trace holds: no failed step was recorded, and the report named no size (None). Here
    # the trace holds 1,000 events: the small CNN's first step makes about 4,000, its later
    # steps about 230, so the short runs are recorded and the failed step is not.
    r = run(SETUP, """
        import gc
        from tf_memguard import _recording
        _recording.TRACE_CAPACITY = 1000
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        try:
            m.fit(x, y, batch_size=1024, epochs=1, verbose=0, callbacks=[cb])
            oom = False
        except tf.errors.ResourceExhaustedError:
            oom = True
        gc.collect()
        lost = cb._sampler.prefix is None
        rep = tf_memguard.report()
        size, method = rep.suggested_batch_size, rep.suggestion_method
        emit(oom=oom, lost=lost, size=size, method=method)
        if size:
            m.fit(x, y, batch_size=size, epochs=1, verbose=0)
            emit(oom=oom, lost=lost, size=size, method=method, retry=True)
    """, env=HARD)
    d = r.data
    assert d["oom"] and d["lost"], d
    # The small CNN trains 233-250 under 128 MiB (README); the runs decide without the
    # failed step's model.
    assert d["size"] is not None and d["size"] >= 100, d
    assert "short fit() runs after the out-of-memory error" in d["method"], d
    assert r.returncode == 0 and d.get("retry"), r   # the retry at the suggestion trained


def test_a_suggestion_to_confirm_is_read_once_and_the_report_keeps_no_model_alive():
    # The confirmation runs when the suggestion is first read; the report (held as
    # report()'s until the next run) holds the model and the callback weakly.
    r = run(SETUP, """
        import gc, weakref
        from tf_memguard._recording import advice_steps
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[cb])
        in_fit = advice_steps()
        rep = tf_memguard.report()
        pending, printed = rep.pending(), str(rep)
        size, method = rep.suggested_batch_size, rep.suggestion_method
        read = advice_steps()
        again = rep.suggested_batch_size
        steps = [in_fit, read, advice_steps()]
        m2 = make()
        m2.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        rep2 = tf_memguard.report()
        ref = weakref.ref(m2)
        del m2
        gc.collect()
        emit(pending=pending, printed=printed, size=size, method=method, again=again, alive=ref() is not None,
             gone=rep2.suggestion_method, steps=steps)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    # What the advice ran beyond fit(): in fit(), the short run at 32 for the second size
    # (64 divides the 1,024 samples), one step; once read, the confirmation's one step:
    # issue 14's "at most two training steps beyond what fit() runs". Where the model named
    # too much (one CI draw: about 520, where about 350 trains), the confirmation is refused
    # and the runs below it decide, at most CONFIRM_RUNS steps in all (a known miss of
    # issue 14's bound, kept so that no size that ran out is named).
    from tf_memguard._confirm import CONFIRM_RUNS
    in_fit, read, again = d["steps"]
    assert in_fit == {"steps": 1, "samples": 32}, d["steps"]
    assert again == read, d["steps"]
    assert d["pending"] and "confirmed by a step at it when report().suggested_batch_size is read" in d["printed"], d
    if "refused" in d["method"]:
        assert 3 <= read["steps"] <= 1 + CONFIRM_RUNS and d["size"] >= 64, d
    else:
        assert read == {"steps": 2, "samples": 32 + d["size"]}, d["steps"]
        assert d["size"] > 64 and d["method"].endswith(f"a step at {d['size']} completed"), d
    assert d["again"] == d["size"], d   # worked out once
    assert d["alive"] is False, "the report kept the model alive"
    assert "not confirmed by a step (the model is gone)" in d["gone"], d


def test_find_batch_size_keeps_room_for_the_validation_arrays_it_is_given():
    # Keras copies fit()'s validation arrays into tensors at the first evaluation and keeps
    # the copy until fit() returns: the second epoch's steps run beside it. Without the
    # validation arrays the answer is for a fit() without them, and with 48 MiB of them
    # under 128 MiB it ran out in the second epoch (as a CNN of the sweep of 2026-12-06 did:
    # 220 named under 256 MiB beside 150 MiB of validation images, 84 the most that trains).
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        xv, yv = pattern_images(4096, seed=1)
        m = make()
        plain = tf_memguard.find_batch_size(m, x, y)
        size = tf_memguard.find_batch_size(m, x, y, validation_data=(xv, yv))
        def two_epochs(b):
            try:
                m.fit(x, y, batch_size=b, epochs=2, verbose=0, validation_data=(xv, yv))
                return True
            except tf.errors.ResourceExhaustedError:
                return False
        trained = two_epochs(size)
        gc.collect()
        # Without waits (as find_batch_size's own steps run): with them, 350 trained once in
        # CI, its requests waiting for the frees that the kernels' order would make.
        tf_memguard.device_pool().set_wait(0)
        plain_trained = two_epochs(plain)
        gc.collect()
        errors = []
        for bad in (tf.data.Dataset.from_tensor_slices((xv, yv)).batch(64), "xv"):
            try:
                tf_memguard.find_batch_size(m, x, y, validation_data=bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        s = tf_memguard.stats()
        emit(plain=plain, size=size, trained=trained, plain_trained=plain_trained, errors=errors,
             val_bytes=xv.nbytes + yv.nbytes, reserved=s["peak_bytes_reserved"], limit=s["bytes_limit"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["trained"] is True, d
    # The room for the copy: the answer is smaller by what the copy would hold.
    assert d["val_bytes"] > 40 << 20 and d["size"] < d["plain"], d
    # What the answer without them costs in that fit(): it runs out (without waits; 160
    # trains so and 180 runs out, where the answers without them are 350-355).
    assert d["plain_trained"] is False, d
    assert all(e is not None and e.startswith("find_batch_size(validation_data=<") and "(x_val, y_val)" in e
               for e in d["errors"]), d
    assert d["reserved"] <= d["limit"], d


def test_find_batch_size_gives_its_steps_the_sample_and_class_weights_fit_will_get():
    # fit()'s sample_weight and class_weight reach find_batch_size's steps (before: a
    # TypeError), and its answer trains with them; bad ones raise ValueError saying what
    # it takes.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        seen = []
        base = small_cnn()
        class Seen(keras.Model):
            def train_step(self, data):
                seen.append(keras.utils.unpack_x_y_sample_weight(data)[2] is not None)   # at tracing
                return super().train_step(data)
        keras.utils.set_random_seed(0)
        m = Seen(base.inputs, base.outputs)
        m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        w = np.random.default_rng(1).random(len(x)).astype("float32")
        cw = {0: 1.0, 1: 2.0, 2: 1.0, 3: 0.5}
        sizes = []
        for kw in (dict(sample_weight=w), dict(class_weight=cw)):
            sizes.append(tf_memguard.find_batch_size(m, x, y, **kw))
            m.fit(x, y, batch_size=sizes[-1], epochs=1, verbose=0, **kw)
        errors = []
        for bad in (dict(sample_weight=w[:10]), dict(sample_weight="w"), dict(class_weight=[1.0, 2.0]),
                    dict(sample_weight=w, class_weight=cw)):
            try:
                tf_memguard.find_batch_size(m, x, y, **bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        emit(sizes=sizes, seen=seen, errors=errors)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert min(d["sizes"]) > 0 and d["seen"] and all(d["seen"]), d
    assert d["errors"][0].startswith("find_batch_size(sample_weight=<ndarray>)") and "(1024)" in d["errors"][0], d
    assert d["errors"][1].startswith("find_batch_size(sample_weight=<str>)"), d
    assert d["errors"][2].startswith("find_batch_size(class_weight=<list>)") and "dict" in d["errors"][2], d
    assert d["errors"][3].startswith("find_batch_size(sample_weight=..., class_weight=...): pass one"), d


def test_a_pydatasets_short_batch_first_is_not_taken_for_a_step_at_its_batch_size():
    # fit() shuffles a PyDataset's batches, so its short batch can come first. Recorded as
    # the first step at the batch size, its small peak made the model say the size fits;
    # after the OOM in the next step the advice named 373 for a CNN at 400 under 256 MiB,
    # which ran out in 2 of 2 fresh processes (sweep of 2026-12-06). Here the batches are
    # 900 and 124 (900 runs out), and the short one comes first: a callback after
    # MemGuardCallback (which has read the batch size, 900, from the first batch) swaps them
    # as fit()'s shuffle can.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()

        class Batches(keras.utils.PyDataset):
            def __init__(self, size):
                super().__init__()
                self.bounds = list(range(0, len(x), size)) + [len(x)]
                self.order = list(range(len(self)))

            def __len__(self):
                return len(self.bounds) - 1

            def __getitem__(self, i):
                i = self.order[i]
                return x[self.bounds[i]:self.bounds[i + 1]], y[self.bounds[i]:self.bounds[i + 1]]

        data = Batches(900)

        class Swap(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                data.order.reverse()

        cb = tf_memguard.MemGuardCallback(verbose=0)
        try:
            m.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Swap()])
            oom = False
        except tf.errors.ResourceExhaustedError:
            oom = True
        first = cb._sampler.first
        gc.collect()
        rep = tf_memguard.report()
        size = rep.suggested_batch_size
        trained = None
        if size:
            try:
                m.fit(Batches(size), epochs=1, verbose=0)
                trained = True
            except tf.errors.ResourceExhaustedError:
                trained = False
        s = tf_memguard.stats()
        emit(oom=oom, size=size, trained=trained, advice=rep.advice, first=first is not None, b0=cb._sampler.b0,
             reserved=s["peak_bytes_reserved"], limit=s["bytes_limit"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["oom"] is True and d["b0"] == 900, d
    # The short step is not the first step at 900: nothing recorded at 900 completed.
    assert d["first"] is False, d
    # The size named, from short runs on a sample of the PyDataset's batches, trains.
    assert d["size"] and d["trained"] is True, d
    assert "Reduce the batch size to" in d["advice"], d
    assert d["reserved"] <= d["limit"], d


def test_a_fit_resumed_at_an_initial_epoch_is_recorded_and_advised():
    # fit(..., initial_epoch=3, epochs=5), as a run resumed from a checkpoint does: Keras'
    # epochs are 3 and 4, and the sampler, which records a fit()'s first two epochs, took
    # them for later ones: nothing was recorded and no size named.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(x, y, batch_size=64, epochs=5, initial_epoch=3, verbose=0, callbacks=[cb])
        rep = tf_memguard.report()
        size = rep.suggested_batch_size
        try:
            m.fit(x, y, batch_size=size, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(size=size, method=rep.suggestion_method, epochs=[e.epoch for e in rep.epochs], trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["epochs"] == [4, 5], d   # the report numbers them as Keras' logs do
    assert d["size"] and d["size"] > 64 and "steps at 64" in d["method"] and d["trained"] is True, d


def test_find_batch_size_refuses_a_dataset_with_a_clear_error_and_changes_nothing():
    # A batched dataset has a length (its batches) and was taken for 10 samples: the
    # answer was 10, meaningless; an infinite one raised TypeError("The dataset is infinite").
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        w0 = [w.copy() for w in m.get_weights()]
        errors = []
        for data in (tf.data.Dataset.from_tensor_slices((x, y)).batch(64),
                     tf.data.Dataset.from_tensor_slices((x, y)).batch(64).repeat()):
            try:
                tf_memguard.find_batch_size(m, data)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        same = all(np.array_equal(a, b) for a, b in zip(w0, m.get_weights()))
        emit(errors=errors, same=same, limit=tf_memguard.stats()["bytes_limit"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert all(e is not None and e.startswith("find_batch_size(x=<") and "takes arrays" in e and "MemGuardCallback" in e
               for e in d["errors"]), d
    assert d["same"] is True and d["limit"] == 128 << 20, d


def test_the_batch_size_of_a_tf_data_pipeline_is_read_from_its_batch():
    r = run("""
        import numpy as np, tensorflow as tf
        from tf_memguard._fit_args import batch_size
        x = np.zeros((100, 4), np.float32)
        base = tf.data.Dataset.from_tensor_slices((x, x))
        cases = {
            "batch": base.batch(16),
            "after_batch": base.shuffle(10).batch(16).map(lambda a, b: (a * 2, b)).cache().repeat().prefetch(2)
                              .take(5).with_options(tf.data.Options()),
            "static": base.batch(16, drop_remainder=True),
            "padded": tf.data.Dataset.from_tensor_slices(x).padded_batch(8).prefetch(1),
            "parallel": base.batch(8, num_parallel_calls=2),
            "rebatched": base.batch(8).unbatch().batch(5),
            "unbatched": base.batch(8).unbatch(),
            "rebatch": base.batch(8).rebatch(4),
            "zipped": tf.data.Dataset.zip((base.batch(8), base.batch(8))),
            "zipped_sizes_differ": tf.data.Dataset.zip((base.batch(8), base.batch(4))),
            "none": base,
        }
        emit(**{k: batch_size({"x": ds}) for k, ds in cases.items()})
    """)
    assert r.returncode == 0, r
    # An element with a static first dimension is a batch as fit() sees it ("unbatched",
    # "none": elements of shape (4,)); where batch()'s size is not the elements' (rebatch, a
    # zip of pipelines batched by different sizes) there is no answer. A zip of pipelines
    # batched by one size has that size (keras.io's MixUp zips two: test_dataset_sample.py).
    assert r.data == {"batch": 16, "after_batch": 16, "static": 16, "padded": 8, "parallel": 8, "rebatched": 5,
                      "unbatched": 4, "rebatch": None, "zipped": 8, "zipped_sizes_differ": None, "none": 4}, r.data


def test_where_the_batch_size_cannot_be_read_the_report_says_so_and_what_to_pass():
    # bucket_by_sequence_length() makes batches of several sizes: the report named no size,
    # and said nothing of why.
    r = run("""
        import numpy as np, tensorflow as tf, keras, tf_memguard
        tf_memguard.install(max_bytes="128MiB")
        rng = np.random.default_rng(0)
        seqs = [rng.integers(1, 100, k).astype("int32") for k in rng.integers(2, 60, 200)]
        ds = tf.data.Dataset.from_generator(lambda: iter(zip(seqs, [0] * len(seqs))), output_signature=(
            tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)))
        ds = ds.bucket_by_sequence_length(lambda s, y: tf.shape(s)[0], [20, 40], [32, 16, 8])
        m = keras.Sequential([keras.Input((None,), dtype="int32"), keras.layers.Embedding(100, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
        m.compile("adam", "mse")
        m.fit(ds, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        rep = tf_memguard.report()
        emit(size=rep.suggested_batch_size, advice=rep.advice, text=str(rep))
    """)
    assert r.returncode == 0, r
    d = r.data
    assert d["size"] is None and "could not be read" in d["advice"], d
    assert "MemGuardCallback(batch_size=...)" in d["advice"] and "none named. The batch size" in d["text"], d


def test_the_partial_last_batch_of_a_tf_data_pipeline_is_known_where_every_epoch_ends_with_it():
    r = run("""
        import numpy as np, tensorflow as tf
        from tf_memguard._fit_args import dataset_partial_batch
        x = np.zeros((100, 4), np.float32)
        base = tf.data.Dataset.from_tensor_slices((x, x))
        cases = {
            "batch": base.shuffle(10).batch(16),
            "kept": base.batch(16).map(lambda a, b: (a * 2, b)).cache().prefetch(2).with_options(tf.data.Options()),
            "parallel": base.batch(16, num_parallel_calls=2).prefetch(1),
            "divides": base.batch(20),
            "dropped": base.batch(16, drop_remainder=True),
            "shuffled_batches": base.batch(16).shuffle(4),
            "repeated": base.batch(16).repeat(),
            "taken": base.batch(16).take(3),
            "filtered_below": base.filter(lambda a, b: True).batch(16),
            "infinite_below": base.repeat().batch(16),
            "none": base,
        }
        emit(**{k: dataset_partial_batch(ds) for k, ds in cases.items()})
    """)
    assert r.returncode == 0, r
    # Only where every epoch ends with batch()'s remainder: not after a shuffle, repeat or
    # take of the batches, nor where the length before batch() is not known.
    assert r.data == {"batch": 4, "kept": 4, "parallel": 4, "divides": None, "dropped": None,
                      "shuffled_batches": None, "repeated": None, "taken": None, "filtered_below": None,
                      "infinite_below": None, "none": None}, r.data


def test_a_tf_data_pipelines_partial_last_batch_is_the_second_size():
    # keras.io's text CNN on its string pipeline (TextVectorization in a map) under 192
    # MiB, at 32 over 3,000 reviews: with one batch size, TensorFlow's convolution
    # backprop workspaces (20 MiB, capped: the same at any size from 20 samples up) were
    # taken as possibly proportional, and 93 was advised where 260 trains; with the
    # epoch's last batch of 24 as the second size, 219, which trained in 3 of 3 processes.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        ds = tf.data.Dataset.from_tensor_slices((x[:1000], y[:1000])).shuffle(256).batch(64).prefetch(2)
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(ds, epochs=2, verbose=0, callbacks=[cb])
        size = cb.report.suggested_batch_size
        ds2 = tf.data.Dataset.from_tensor_slices((x[:1000], y[:1000])).shuffle(256).batch(size).prefetch(2)
        try:
            m.fit(ds2, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(suggested=size, method=cb.report.suggestion_method, trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    assert "steps at 64 and 40" in r.data["method"], r.data   # 1,000 = 15 x 64 + 40
    assert r.data["trained"] is True, f"the suggestion {r.data['suggested']} ran out of memory"


def test_a_tf_data_pipeline_with_no_partial_batch_gets_its_second_size_from_a_sample():
    # Batches that divide the elements (or drop_remainder, or TFRecord files read through
    # interleave, whose length is not known) leave fit() no second size: with one size,
    # every block no batch tag marks was taken as possibly proportional (tensorflow.org's
    # TFRecord pipeline into a CNN under 128 MiB: 49 advised at 32 where 120 trains). The
    # short fit() at half the size now runs on a sample of the dataset's first batches.
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        def pipeline(size):
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).batch(size).prefetch(2)  # 1,024
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(pipeline(64), epochs=2, verbose=0, callbacks=[cb])
        size = cb.report.suggested_batch_size
        try:
            m.fit(pipeline(size), epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(suggested=size, method=cb.report.suggestion_method, trained=trained,
             peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, env=HARD)
    assert r.returncode == 0, r
    assert "steps at 64 and 32" in r.data["method"], r.data   # 1,024 = 16 x 64: no partial batch
    assert r.data["suggested"] > 128 and r.data["trained"] is True, r.data
    assert r.data["peak_reserved"] <= 128 << 20, r.data


def test_the_first_epochs_warning_does_not_vouch_for_a_size_the_validation_copy_leaves_no_room_for():
    # keras.io's timeseries anomaly-detection autoencoder (Conv1D, Conv1DTranspose; its
    # forward pass takes a 25.5 MiB workspace whatever the batch) with validation_split=0.1
    # under 48 MiB at 128: epoch 1 peaked at 47.6 MiB and the warning said "A batch size of
    # up to 128 (now 128) fits" (the size had run its epoch), where the model, with Keras'
    # copy of the validation arrays that every later epoch holds, put 128 at 48.8 MiB; epoch
    # 2 ran out in 3 of 3 processes. The size that ran vouches for itself only once an epoch
    # ran with that copy.
    r = run(SETUP, """
        import gc, re, warnings
        tf_memguard.install(max_bytes="48MiB")
    """, TIMESERIES_AUTOENCODER, """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                m.fit(xs, xs, batch_size=128, epochs=2, validation_split=0.1, verbose=0,
                      callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
                outcome = "trained"
            except tf.errors.ResourceExhaustedError:
                outcome = "ran out"
        said = [str(w.message) for w in caught if "peaked at" in str(w.message)]
        gc.collect()
        named = [int(v) for v in re.findall(r"(?:Reduce the batch size to|up to) (\\d+)", said[0])] if said else []
        retry, size, waits = None, tf_memguard.report().suggested_batch_size, None
        if outcome == "ran out":
            # At once, in this process, at the size the report names after the OOM (the
            # warning's is for the next run: a fresh process trained two epochs at its 106
            # in 2 of 2). Its requests must wait for frees as the first run's did.
            before = tf_memguard.stats()["num_waits"]
            try:
                m.fit(xs, xs, batch_size=size, epochs=2, validation_split=0.1, verbose=0)
                retry = "trained"
            except tf.errors.ResourceExhaustedError:
                retry = "ran out"
            waits = tf_memguard.stats()["num_waits"] - before
        emit(outcome=outcome, said=said, named=named, size=size, retry=retry, waits=waits,
             peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["said"], d   # the first epoch peaks near the budget
    assert "up to 128 (now 128) fits" not in d["said"][0], d
    if d["outcome"] == "ran out":
        assert d["named"] and d["named"][0] < 128, d
        # The retry right after the OOM ran out at the report's 101-105 in 3 of 3 local
        # processes (and one CI run) with no request waiting: the failed step's episode of
        # refusals at once (free_wait.h) went on into it. Ended once the call returned.
        assert d["retry"] == "trained" and d["waits"] > 0, d
    assert d["peak_reserved"] <= 48 << 20, d


def test_a_fit_on_tensors_gets_advice_as_a_fit_on_arrays_does():
    # fit(x, y) with TensorFlow tensors (data preprocessed with TensorFlow's ops) is batched
    # by fit() as arrays are, but the callback learned the batch size only from arrays: no
    # advice at all (suggested_batch_size None, an empty method).
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        xt, yt = tf.constant(x[:1000]), tf.constant(y[:1000])
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(xt, yt, batch_size=64, epochs=2, verbose=0, callbacks=[cb])
        size = cb.report.suggested_batch_size
        try:
            m.fit(xt, yt, batch_size=size, epochs=2, verbose=0)
            trained = True
        except tf.errors.ResourceExhaustedError:
            trained = False
        emit(suggested=size, method=cb.report.suggestion_method, trained=trained)
    """, env=HARD)
    assert r.returncode == 0, r
    assert "steps at 64 and 40" in r.data["method"], r.data   # the partial last batch: 1,000 = 15 x 64 + 40
    assert r.data["suggested"] > 128 and r.data["trained"] is True, r.data


def test_a_fit_on_a_batched_dataset_gets_advice_without_being_told_the_batch_size():
    r = run(SETUP, """
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256).batch(64).prefetch(2)  # 1,024 samples
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(ds, epochs=2, verbose=0, callbacks=[cb])
        emit(suggested=cb.report.suggested_batch_size, method=cb.report.suggestion_method)
    """, env=HARD)
    assert r.returncode == 0, r
    # The README's CNN under 128 MiB trains at 370 and more with arrays: far above 64.
    assert r.data["suggested"] is not None and r.data["suggested"] > 128, r.data


def test_after_an_oom_on_a_dataset_a_sample_of_its_batches_gives_a_size_that_trains():
    # A tf.data pipeline fixes its own batches, and the short runs after an OOM need arrays:
    # they run on its first batches, taken as arrays, with room for what its pipeline holds
    # beside the step (a shuffle buffer, a map's elements). Before, no size was suggested.
    r = run(SETUP, """
        import gc
        tf_memguard.install(max_bytes="128MiB")
        x, y = pattern_images(2048)
        def pipeline(size):
            return (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512)
                    .map(lambda a, b: (tf.image.random_flip_left_right(a), b)).batch(size).prefetch(2))
        m = make()
        ds = pipeline(1024)
        try:
            m.fit(ds, epochs=1, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
            outcome, notes = "trained", ""
        except tf.errors.ResourceExhaustedError as e:
            outcome, notes = type(e).__name__, "\\n".join(getattr(e, "__notes__", []))
            del e
        gc.collect()
        rep = tf_memguard.report()
        size, method, advice = rep.suggested_batch_size, rep.suggestion_method, rep.advice
        ds = pipeline(size)   # the user's retry: the pipeline rebuilt at the suggested size
        gc.collect()
        try:
            loss = m.fit(ds, epochs=2, verbose=0,
                         callbacks=[tf_memguard.MemGuardCallback(verbose=0)]).history["loss"][-1]
        except tf.errors.ResourceExhaustedError:
            loss = None
        emit(outcome=outcome, notes=notes, size=size, method=method, advice=advice, loss=loss,
             peak_reserved=tf_memguard.stats()["peak_bytes_reserved"])
    """, env=HARD, timeout=900)
    assert r.returncode == 0, r
    d = r.data
    assert d["outcome"] == "ResourceExhaustedError", d
    assert "on the dataset's first batches, taken as arrays" in d["notes"], d["notes"]
    assert d["size"] is not None and 32 <= d["size"] < 1024, d
    assert "on the dataset's first" in d["method"] and f".batch({d['size']})" in d["advice"], d
    assert f"batch_size={d['size']} where a Keras utility" in d["advice"], d["advice"]   # timeseries_dataset_...
    assert d["peak_reserved"] <= 128 << 20, d
    if d["loss"] is None:
        # A known miss (issue 14 stays open): this CNN's need on the dataset is not monotonic
        # in the batch size (steps at 300 peaked at 108-120 MiB, at 329 at 96-103), and a
        # size whose short runs and four-step run completed ran out over two epochs in one
        # fresh-clone CI run of 2026-12-03 (286, 252 and 286 trained in three reruns).
        pytest.xfail(f"the retry at the suggested {d['size']} ran out (benchmarks/NOTES.md)")
    assert d["loss"] > 0, d


def test_after_an_oom_on_a_dataset_no_one_kept_the_advice_says_why_there_is_no_size():
    r = run(SETUP, """
        import gc
        tf_memguard.install(max_bytes="128MiB")
        m = make()
        try:
            m.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(1024), epochs=1, verbose=0,
                  callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
        except tf.errors.ResourceExhaustedError as e:
            del e
        gc.collect()
        rep = tf_memguard.report()
        emit(size=rep.suggested_batch_size, advice=rep.advice, in_use=tf_memguard.stats()["bytes_in_use"])
    """, env=HARD)
    assert r.returncode == 0, r
    assert r.data["size"] is None and "Keep it in a variable" in r.data["advice"], r.data
    # The dataset is not kept alive by the callback or the report: its tensors are gone.
    assert r.data["in_use"] < 8 << 20, r.data


def test_leak_rule():
    from tf_memguard._report import leak_verdict
    MiB = 1 << 20
    assert leak_verdict([10 * MiB, 10 * MiB]) == "too few epochs to tell"
    assert leak_verdict([10 * MiB, 20 * MiB, 30 * MiB, 40 * MiB]).startswith("possible leak: live bytes at epoch end grew 3")
    assert leak_verdict([10 * MiB, 20 * MiB, 20 * MiB, 40 * MiB]) == "no leak"
    assert leak_verdict([10 * MiB, 10 * MiB + 1000, 10 * MiB + 2000, 10 * MiB + 3000]) == "no leak"




RAN = f"""
import sys
sys.path.insert(0, {EXAMPLES!r})
import tensorflow as tf, keras, tf_memguard
from tf_memguard import _memory_model
from _data import pattern_images, small_cnn
_memory_model.LAYOUT_SLACK = @SLACK@
tf_memguard.install(max_bytes=@BUDGET@)
x, y = pattern_images(1024)
keras.utils.set_random_seed(0)
m = small_cnn()
m.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
m.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[tf_memguard.MemGuardCallback(verbose=0)])
rep = tf_memguard.report()
emit(peak=rep.peak_bytes, suggested=rep.suggested_batch_size,
     model_says_fits=bool(rep.model().fits(64, @BUDGET@)))
"""


def test_the_advice_never_names_less_than_the_batch_size_that_ran():
    # A size that ran its epochs within the budget fits, whatever the model's margins say.
    # (The zoo's embedding model at 256 under 76 MiB: its first step, building Adam's slots
    # of a 12 MiB table, peaked at 98% of the budget, and with 2% kept free the advice was
    # "no batch size fits" while the run went on.) Here the margin kept for a long run's
    # layout is made 35% of the budget, 25% over what the run at 64 needed before.
    first = run(RAN.replace("@SLACK@", "0.02").replace("@BUDGET@", str(1 << 28)), env=HARD)
    assert first.returncode == 0, first
    budget = int(first.data["peak"] * 1.25)
    r = run(RAN.replace("@SLACK@", "0.35").replace("@BUDGET@", str(budget)), env=HARD)
    assert r.returncode == 0, r
    assert not r.data["model_says_fits"], r.data   # the margins say 64 does not fit...
    assert r.data["suggested"] >= 64, r.data       # ...and 64 ran


def test_the_arrays_keras_copies_are_sized_as_keras_feeds_them():
    r = run("""
        import numpy as np, tensorflow as tf
        from tf_memguard._fit_args import fed_nbytes, validation_arrays
        x64, x32, labels = np.zeros((10, 3)), np.zeros((10, 3), np.float32), np.zeros(10, np.int64)
        val = (np.zeros((4, 3)), np.zeros(4))
        ds = tf.data.Dataset.from_tensor_slices(x32).batch(2)
        emit(sizes=[fed_nbytes(a) for a in (x64, x32, labels, np.zeros((10, 3), np.float16))],
             two=len(validation_arrays({"validation_data": val, "epochs": 2}) or []),
             one=validation_arrays({"validation_data": val, "epochs": 1}),
             resumed=validation_arrays({"validation_data": val, "epochs": 3, "initial_epoch": 2}),
             dataset=validation_arrays({"validation_data": ds, "epochs": 2}),
             none=validation_arrays({"epochs": 2}))
    """)
    assert r.returncode == 0, r
    # float64 and float16 arrays are cast to floatx (float32) before the copy; integers
    # are not. The validation arrays' copy matters only to epochs after the first.
    assert r.data == {"sizes": [120, 120, 80, 120], "two": 2, "one": None, "resumed": None, "dataset": None,
                      "none": None}, r.data


@pytest.mark.parametrize("wait", [None, 0])
def test_with_wait_0_every_size_named_says_it_has_no_margin_for_orders_not_met(wait):
    # The waits near the budget are part of the advice's margin (README): keras.io's SAM
    # under 192 MiB with wait=0 was advised 175 and, after an OOM, 166, whose retry ran out
    # in 2 of 2 processes (156 trains with wait=0). With wait=0 the advice says so.
    r = run(SETUP, f"""
        tf_memguard.install(max_bytes="128MiB", wait={wait!r})
        m = make()
        cb = tf_memguard.MemGuardCallback(verbose=0)
        m.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[cb])
        rep = tf_memguard.report()
        emit(size=rep.suggested_batch_size, advice=rep.advice, text=str(rep))
    """, env=HARD)
    assert r.returncode == 0, r
    d = r.data
    assert d["size"] and d["size"] > 64, d
    said = "With install(wait=0) the size has no margin" in d["advice"]
    assert said == (wait == 0), d
