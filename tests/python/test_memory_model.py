"""The memory model of a training step (tf_memguard._memory_model), on steps made with the
pool directly: which blocks are fixed, proportional or capped, the replay through the pool's
own code, the largest batch size that fits, and the saved model. No TensorFlow (one test
imports Keras to size a batch)."""
import dataclasses
import json
import re
import subprocess
import sys

import numpy as np

import tf_memguard
from tf_memguard import _memory_model as mm
from tf_memguard import _after_oom, _model_build, _step_trace

MiB = 1 << 20


def step(pool, b, cap=None, tag=True):
    """A synthetic training step at batch size b: activations of 1 MiB per sample (tagged,
    first dimension the batch), a fixed 3 MiB workspace, an untagged 0.5 MiB per sample (a
    transposed tensor), and a workspace tagged at small sizes but capped at `cap` MiB."""
    sizes = [(b * MiB, tag), (3 * MiB, False), (b * MiB // 2, False)]
    if cap is not None:
        sizes.append((min(b, cap) * MiB, tag and b <= cap))
    blocks = [pool.allocate(s, batch=t, kind="kernel") for s, t in sizes]
    for a in blocks[::-1]:
        pool.free(a)


def record(pool, b, **kw):
    live = pool.live_blocks()
    pool.trace_start(1 << 16)
    step(pool, b, **kw)
    pool.trace_start(0)
    return _step_trace.StepTrace.from_pool(pool, live, b)


def make_pool():
    pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
    pool.allocate(4 * MiB, kind="kernel")  # weights, live at every step's start
    return pool


def true_need(b, cap=None):
    return (4 + b + 3 + b / 2 + (min(b, cap) if cap else 0)) * MiB


def test_two_steps_give_every_block_its_line_and_the_replay_its_peak():
    pool = make_pool()
    model = mm.StepModel.build(record(pool, 32), record(pool, 16))
    for b in (8, 16, 32, 64, 100):
        assert model.need(b)["peak_account"] == true_need(b), b
    # The recorded step's own peak comes out of the replay as measured.
    assert model.need(32)["peak_account"] == true_need(32)


def test_one_step_bounds_what_it_cannot_tell_on_the_safe_side():
    pool = make_pool()
    model = mm.StepModel.build(record(pool, 32), None)
    # Untagged blocks could be fixed or proportional: above the recorded size the model
    # takes proportional (more), below it fixed (more).
    assert model.need(64)["peak_account"] >= true_need(64)
    assert model.need(16)["peak_account"] >= true_need(16)
    assert model.need(32)["peak_account"] == true_need(32)


def test_a_tagged_workspace_that_stops_growing_is_seen_from_the_second_step():
    # Tagged at 16 (first dimension = the batch), capped at 24: at 32 it is 24 MiB.
    pool = make_pool()
    model = mm.StepModel.build(record(pool, 32, cap=24), record(pool, 16, cap=24))
    # Without the second step the model would scale it as a batch-shaped tensor.
    assert model.need(32)["peak_account"] == true_need(32, cap=24)
    assert model.need(64)["peak_account"] <= true_need(64, cap=64)   # less than proportional
    assert model.need(64)["peak_account"] >= true_need(64, cap=24)   # the line through both: safe


def largest(budget_mib, step_fixed_mib, start_mib=4):
    """The largest b whose step of start + fixed + 1.5 b MiB fits `budget_mib`, with
    LAYOUT_SLACK of the budget and RUN_SPREAD of what the step's own bytes grew by from a
    batch of 1 (1.5 (b - 1) MiB) kept free."""
    s = mm.RUN_SPREAD
    return int(((1 - mm.LAYOUT_SLACK) * budget_mib - start_mib - step_fixed_mib + 1.5 * s) / (1.5 * (1 + s)))


def test_the_largest_batch_size_that_fits_is_the_one_whose_replay_fits():
    pool = make_pool()
    model = mm.StepModel.build(record(pool, 32), record(pool, 16))
    budget = 200 * MiB
    best = model.largest_fitting(budget)
    # 4 + 3 + 1.5 b MiB within 98% of the budget (LAYOUT_SLACK kept free for the layout), and
    # RUN_SPREAD of what its own bytes grew by from a batch of 1 kept free for orders of its
    # kernels not met.
    assert best == largest(200, 3) == 117, best
    assert model.fits(best, budget) and not model.fits(best + 1, budget)
    assert model.largest_fitting(budget, at_most=40) == 40
    assert mm.StepModel.build(record(pool, 32), None).largest_fitting(6 * MiB) == 0   # nothing fits
    assert model.budget_for(best) <= budget + (64 << 10)   # found to 64 KiB


def test_steps_in_one_order_keep_nothing_for_orders_not_met():
    # PyTorch's eager steps allocate in one order every time (StepTrace.ordered); the
    # RUN_SPREAD kept for TensorFlow's orders is not kept for them.
    import dataclasses
    pool = make_pool()
    a, b = record(pool, 32), record(pool, 16)
    drawn = mm.StepModel.build(a, b)
    ordered = mm.StepModel.build(dataclasses.replace(a, ordered=True), dataclasses.replace(b, ordered=True))
    assert ordered.need(100) == drawn.need(100)
    assert ordered.unseen_order_bytes(100) == 0
    assert drawn.unseen_order_bytes(100) == int(mm.RUN_SPREAD * 1.5 * 99 * MiB)   # what the step grew by from 1
    assert ordered.largest_fitting(200 * MiB) == int((0.98 * 200 - 7) / 1.5) == 126
    assert mm.StepModel.from_dict(ordered.to_dict()).largest_fitting(200 * MiB) == 126


def test_a_step_that_ran_in_its_only_order_keeps_no_granule_per_large_block_at_its_size(monkeypatch):
    # Where the pool backs memory in 2 MiB granules (a GPU's), a model keeps a granule free
    # per large block live at the peak: another order, or a line through one or two sizes,
    # can lay them out worse. Asked whether the step that ran fits at its own size
    # (as_run, the short runs after an OOM), a step of PyTorch's (StepTrace.ordered: one
    # order every time) keeps LAYOUT_SLACK of the budget only; TensorFlow's steps, and
    # every other size, keep the granules.
    import dataclasses
    monkeypatch.setenv("TF_MEMGUARD_HOST_GRANULE", str(2 * MiB))   # read when the upstream is made
    pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
    pool.allocate(4 * MiB, kind="kernel")
    assert pool.layout()["page_bytes"] == 2 * MiB

    def rec(b):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        # Twelve large blocks (each at least small_threshold) live together at the peak.
        blocks = [pool.allocate(b * MiB // 4 + 12345, batch=True, kind="kernel") for _ in range(12)]
        for a in blocks[::-1]:
            pool.free(a)
        pool.trace_start(0)
        return _step_trace.StepTrace.from_pool(pool, live, b)
    at64 = rec(64)
    drawn = mm.StepModel.build(at64, None)
    ordered = mm.StepModel.build(dataclasses.replace(at64, ordered=True), None)
    budget = int(ordered.need(64)["peak_bytes_reserved"] / (1 - mm.LAYOUT_SLACK)) + (1 << 16)
    assert ordered.need(64)["large_blocks_at_peak"] == 12
    granules = 12 * 2 * MiB
    assert granules > mm.LAYOUT_SLACK * budget
    assert ordered.layout_margin(64, budget, as_run=True) == int(mm.LAYOUT_SLACK * budget)
    assert ordered.layout_margin(64, budget) == granules
    assert ordered.layout_margin(63, budget, as_run=True) == granules   # not the size that ran
    assert drawn.layout_margin(64, budget, as_run=True) == granules     # other orders can come
    assert ordered.fits(64, budget, as_run=True) and not ordered.fits(64, budget)
    assert not drawn.fits(64, budget, as_run=True)


def flattened_step(pool, b):
    """A step with two batch-shaped tensors flattened to (b x steps, features), of b / 8
    and b / 16 MiB (a Dense layer's output and input on 3-D data): the larger at 16 has
    the size of the smaller at 32. Returns the trace with those blocks hinted as rows of
    the batch (TFMG_ALLOC_BATCH_ROWS), as TensorFlow's plugin tags them."""
    live = pool.live_blocks()
    pool.trace_start(1 << 16)
    blocks = [pool.allocate(b * MiB // 8, kind="kernel"), pool.allocate(b * MiB // 16, kind="kernel"),
              pool.allocate(b * MiB, batch=True, kind="kernel")]
    for a in blocks[::-1]:
        pool.free(a)
    pool.trace_start(0)
    t = _step_trace.StepTrace.from_pool(pool, live, b)
    alloc = t.op != 1
    t.flags = np.where(alloc & (t.size < b * MiB), t.flags | tf_memguard._core.ALLOC_BATCH_ROWS, t.flags)
    return t


def test_blocks_whose_first_dimension_is_a_multiple_of_the_batch_scale_with_it():
    pool = make_pool()
    at32, at16 = flattened_step(pool, 32), flattened_step(pool, 16)
    model = mm.StepModel.build(at32, at16)
    for b in (64, 128):
        assert model.need(b)["peak_account"] == (4 + b + b / 8 + b / 16) * MiB, b
    # Without the hint, the 2 MiB block at 32 pairs with the 2 MiB one at 16 and is taken
    # as fixed: the model falls short at larger sizes.
    for t in (at32, at16):
        t.flags = t.flags & ~np.uint32(tf_memguard._core.ALLOC_BATCH_ROWS)
    blind = mm.StepModel.build(at32, at16)
    assert blind.need(128)["peak_account"] < (4 + 128 + 128 / 8 + 128 / 16) * MiB


def square_step(pool, b, hint=True):
    """A step with 1 MiB a sample of activations (tagged) and a batch x batch block of
    b * b * 4 KiB (a contrastive loss's similarities, 1,024 floats per pair), hinted
    TFMG_ALLOC_BATCH_SQUARE as TensorFlow's plugin tags it (its first two dimensions the
    batch)."""
    live = pool.live_blocks()
    pool.trace_start(1 << 16)
    core = tf_memguard._core
    blocks = [pool.allocate(b * MiB, batch=True, kind="kernel"), pool.allocate(b * b * 4096, batch=True, kind="kernel")]
    for a in blocks[::-1]:
        pool.free(a)
    pool.trace_start(0)
    t = _step_trace.StepTrace.from_pool(pool, live, b)
    if hint:
        t.flags = np.where((t.op != 1) & (t.size == b * b * 4096), t.flags | core.ALLOC_BATCH_SQUARE, t.flags)
    return t


def square_need(b):
    return (4 + b) * MiB + b * b * 4096


def test_a_batch_by_batch_block_grows_with_the_square_of_the_batch():
    pool = make_pool()
    at32, at16 = square_step(pool, 32), square_step(pool, 16)
    model = mm.StepModel.build(at32, at16)
    for b in (8, 32, 64, 128):
        assert model.need(b)["peak_account"] == square_need(b), b
    # Saved in a report, the model answers the same.
    assert mm.StepModel.from_dict(json.loads(json.dumps(model.to_dict()))).need(128)["peak_account"] == square_need(128)
    # Without the hint the block's line through both sizes passes below the origin: it is
    # taken as proportional above the recorded size, and the model falls short at 128.
    blind = mm.StepModel.build(square_step(pool, 32, hint=False), square_step(pool, 16, hint=False))
    assert blind.need(128)["peak_account"] < square_need(128)
    # A dimension equal to the batch by chance (hinted, but its partner at 16 is
    # proportional) stays a line.
    at16_lin = square_step(pool, 16)
    lin32 = square_step(pool, 32)
    lin16 = dataclasses.replace(at16_lin, size=np.where(at16_lin.size == 16 * 16 * 4096, 16 * 32 * 4096, at16_lin.size))
    assert mm.StepModel.build(lin32, lin16).need(64)["peak_account"] == (4 + 64) * MiB + 64 * 32 * 4096


def test_steps_in_one_order_pair_a_batch_by_batch_block_by_its_place():
    # PyTorch's blocks carry no tags: in steps allocating in one order, a pair of the same
    # place whose sizes are in the square of the batch ratio is one batch x batch tensor.
    pool = make_pool()
    a = dataclasses.replace(square_step(pool, 32, hint=False), ordered=True)
    b = dataclasses.replace(square_step(pool, 16, hint=False), ordered=True)
    model = mm.StepModel.build(a, b)
    assert model.need(128)["peak_account"] == square_need(128)


def test_a_step_recorded_where_the_batch_size_divides_the_samples_has_its_own_domain():
    pool = make_pool()
    light = mm.StepModel.build(record(pool, 32), record(pool, 16))
    heavy = mm.StepModel.build(record(pool, 32, cap=8), record(pool, 16, cap=8))   # 8 MiB more
    both = mm.StepModels([light, heavy], ["static", "dynamic"], samples=4096)
    budget = 200 * MiB
    # Sizes that divide 4096 run the light trace, the others the heavy one.
    assert both.need(64)["peak_account"] == light.need(64)["peak_account"]
    assert both.need(65)["peak_account"] == heavy.need(65)["peak_account"]
    # The heavy trace fits up to 112 (4 + 11 + 1.5 b MiB), the light one up to 117
    # (4 + 3 + 1.5 b), and the largest divisor of 4096 under that is 64.
    assert heavy.largest_fitting(budget) == largest(200, 11) == 112
    assert light.largest_fitting(budget) == largest(200, 3) == 117
    assert both.largest_fitting(budget) == 112
    # Under 217 MiB the heavy trace fits up to 123 and the light one up to 128, a divisor.
    assert (largest(217, 11), largest(217, 3)) == (123, 128)
    assert both.largest_fitting(217 * MiB) == 128
    # A model of the unknown-size trace that needs less than the known-size one's (one
    # short fit()'s step, a low draw) does not lower a size's need below the latter's: that
    # trace needs at least as much.
    low = mm.StepModels([heavy, light], ["static", "dynamic"], samples=4096)
    assert low.need(65)["peak_account"] == heavy.need(65)["peak_account"]
    assert low.largest_fitting(budget) == 112


def test_a_model_saved_in_a_report_answers_the_same():
    pool = make_pool()
    model = mm.StepModels([mm.StepModel.build(record(pool, 32), record(pool, 16))], samples=4096)
    back = mm.StepModels.from_dict(json.loads(json.dumps(model.to_dict())))
    for b in (10, 50, 90):
        assert back.need(b) == model.need(b)
    assert back.largest_fitting(150 * MiB) == model.largest_fitting(150 * MiB)


def test_a_shortfall_shown_by_a_refused_size_goes_with_the_saved_model():
    # A refused confirmation run shows the model short at that size, and the report's model
    # (the what-if's) must keep it: a pandas MLP's run under 48 MiB was refused at 3,628
    # and 3,386, and the what-if from its report said 7,714 fits 96 MiB, where 7,714 ran
    # out in 2 of 2 processes (its steps at 1,400 and 1,200 under-predict larger sizes).
    from tf_memguard._recording import SHORTFALL_FLAGS
    pool = make_pool()
    model = mm.StepModel.build(record(pool, 32), record(pool, 16))
    short = model.with_shortfall(0.25 * MiB, SHORTFALL_FLAGS)   # a quarter MiB more per sample
    for b in (8, 32, 100):
        assert short.need(b)["peak_account"] == true_need(b) + b * MiB // 4, b
        assert model.need(b)["peak_account"] == true_need(b), b   # the model itself unchanged
    assert model.with_shortfall(0, SHORTFALL_FLAGS) is model
    budget = 200 * MiB
    assert short.largest_fitting(budget) < model.largest_fitting(budget)
    # The step's blocks still free what they freed (their slots moved up by one): twice
    # over, the shortfall stays one block.
    twice = short.with_shortfall(0.25 * MiB, SHORTFALL_FLAGS)
    assert twice.need(64)["peak_account"] == true_need(64) + 64 * MiB // 2
    back = mm.StepModels.from_dict(json.loads(json.dumps(mm.StepModels([short]).to_dict())))
    assert back.need(50) == short.need(50)


def test_what_if_from_the_command_line(tmp_path):
    pool = make_pool()
    model = mm.StepModels([mm.StepModel.build(record(pool, 32), record(pool, 16))], samples=4096)
    report = tf_memguard.Report(budget_bytes=128 * MiB, batch_size=32, memory_model=model.to_dict(), samples=4096)
    path = tmp_path / "report.json"
    report.to_json(str(path))
    out = subprocess.run([sys.executable, "-m", "tf_memguard", "what-if", str(path), "--budget", "120MiB",
                          "--batch-size", "64", "--batch-size", "80"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^\s+64\s+103 MiB\s+yes$", out.stdout, re.M), out.stdout
    assert re.search(r"^\s+80\s+127 MiB\s+no$", out.stdout, re.M), out.stdout
    assert f"largest batch size that fits: {largest(120, 3)}" in out.stdout, out.stdout   # 69
    bad = subprocess.run([sys.executable, "-m", "tf_memguard", "what-if", str(path), "--budget", "lots"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--budget='lots'" in bad.stderr



def test_untagged_steps_in_the_same_order_are_matched_by_position():
    # PyTorch's steps come untagged (no shapes at the allocator), in the same order each
    # time. In a CNN the first layer's output at 2b samples (b MiB x 2) is as large as the
    # next layer's (twice the channels) at b: matched by size, both would look fixed.
    import dataclasses

    def cnn_step(pool, b):
        blocks = [pool.allocate(2 * b * MiB // 32, kind="other"), pool.allocate(4 * b * MiB // 32, kind="other")]
        for a in blocks[::-1]:
            pool.free(a)

    def rec(pool, b):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        cnn_step(pool, b)
        pool.trace_start(0)
        return dataclasses.replace(_step_trace.StepTrace.from_pool(pool, live, b), ordered=True)

    pool = make_pool()
    t64, t32 = rec(pool, 64), rec(pool, 32)
    need = mm.StepModel.build(t64, t32).need(128)["peak_account"]
    assert need == (4 + 2 * 4 + 4 * 4) * MiB   # weights 4 MiB, 8 and 16 MiB at 128
    unordered = mm.StepModel.build(dataclasses.replace(t64, ordered=False), dataclasses.replace(t32, ordered=False))
    assert unordered.need(128)["peak_account"] < need   # the coincidence fools the size match


def test_batches_prepared_ahead_are_bounded_by_the_epoch():
    """tf.data's batches live at a step's start (here two of 0.25 MiB per sample, tagged)
    scale with the batch size, but an epoch over n samples holds at most floor(n / b) full
    batches: above n / 2 samples, one."""
    n, per = 1000, MiB // 4

    def recorded(b):
        pool = make_pool()
        prepared = [pool.allocate(b * per, batch=True, kind="data") for _ in range(2)]
        t = record(pool, b)
        for p in prepared:
            pool.free(p)
        return t
    t64, t32 = recorded(64), recorded(32)
    free = mm.StepModel.build(t64, t32)
    bounded = mm.StepModel.build(t64, t32, epoch=(n, per))
    for b in (64, 300, 400):  # two batches fit in the epoch: no bound
        assert bounded.need(b)["peak_account"] == free.need(b)["peak_account"], b
    for b in (600, 900):  # one batch at most
        want = free.need(b)["peak_account"] - b * per
        assert bounded.need(b)["peak_account"] == want, b
    # The bound can only lower the need, and the model without an epoch is unchanged.
    assert bounded.largest_fitting(800 * MiB) >= free.largest_fitting(800 * MiB)
    saved = mm.StepModel.from_dict(json.loads(json.dumps(bounded.to_dict())))
    assert saved.need(900)["peak_account"] == bounded.need(900)["peak_account"]


def test_a_step_that_made_the_whole_epochs_batches_is_bounded_by_the_epoch_at_every_size():
    """A run's first step over n = 1,000 samples of two arrays (x, y: 16 KiB per sample
    each) at b = 300 meets no batch at its start: it makes its own (tagged, freed once
    used), the epoch's two other full batches (tagged, prepared ahead) and its partial
    batch of 100 (untagged: its first dimension is not b). At b = 400 the epoch holds one
    full batch besides the step's own and a partial one of 200; above 500, none and a
    partial one of n - b. The model gives each size exactly that (the old bound kept one
    full batch too many, and the partial batch at its recorded size)."""
    n, per = 1000, 16 << 10
    act = MiB // 4

    def first_step(pool, b):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        own = [pool.allocate(b * per, batch=True, kind="kernel") for _ in range(2)]
        ahead = [pool.allocate(b * per, batch=True, kind="kernel") for _ in range(2 * (n // b - 1))]
        partial = [pool.allocate(n % b * per, kind="kernel") for _ in range(2)] if n % b else []
        a = pool.allocate(b * act, batch=True, kind="kernel")
        pool.free(a)
        for o in own:
            pool.free(o)
        pool.trace_start(0)
        t = _step_trace.StepTrace.from_pool(pool, live, b)
        for blk in ahead + partial:
            pool.free(blk)
        return t

    def truth(b):  # weights, the step's own batch, the others, the partial one, the activation
        return 4 * MiB + 2 * per * (b + (n // b - 1) * b + n % b) + b * act

    pool = make_pool()
    t300, t200 = first_step(pool, 300), first_step(pool, 200)
    model = mm.StepModel.build(t300, t200, first=True, epoch=(n, 2.0 * per, (float(per), float(per))))
    for b in (300, 400, 450, 600, 900):
        got = model.need(b)["peak_account"]
        assert abs(got - truth(b)) <= 16 * 64, (b, got / MiB, truth(b) / MiB)
    saved = mm.StepModel.from_dict(json.loads(json.dumps(model.to_dict())))
    assert saved.need(600)["peak_account"] == model.need(600)["peak_account"]
    # Recorded at a size that divides the samples, the step met no partial batch: at one
    # that does not, the epoch's rest (its partial batch among it) is still held.
    pool = make_pool()
    t250, t200 = first_step(pool, 250), first_step(pool, 200)
    divides = mm.StepModel.build(t250, t200, first=True, epoch=(n, 2.0 * per, (float(per), float(per))))
    for b in (250, 400, 600, 900):
        assert divides.need(b)["peak_account"] >= truth(b) - 16 * 64, b
    # Without the arrays' sizes (a report saved before them) the bound is the older one:
    # never less than the truth.
    plain = mm.StepModel.build(t300, t200, first=True, epoch=(n, 2.0 * per))
    assert all(plain.need(b)["peak_account"] >= truth(b) - 16 * 64 for b in (400, 600, 900))


def test_a_batch_scaled_to_the_other_size_does_not_take_a_fixed_workspaces_partner():
    """A fixed 1 MiB workspace (untagged) in steps at 16 and 32; at 16 two batch-shaped
    blocks of 32 KiB a sample (one a batch prepared ahead, which the step at 32 did not
    meet), at 32 one: 1 MiB, the workspace's size. The batch blocks' partners are tagged
    ones; the workspace stays fixed (it used to lose its partner to the second batch block
    and be taken as proportional: 4 MiB at 64)."""
    def made(pool, b, batches):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        blocks = [pool.allocate(b * (32 << 10), batch=True, kind="kernel") for _ in range(batches)]
        blocks.append(pool.allocate(MiB, kind="kernel"))
        for a in blocks[::-1]:
            pool.free(a)
        pool.trace_start(0)
        return _step_trace.StepTrace.from_pool(pool, live, b)
    pool = make_pool()
    t16, t32 = made(pool, 16, 2), made(pool, 32, 1)
    fixed_lo, lo, fixed_hi, hi, _ = _model_build.match(t16, t32)
    assert (fixed_lo[2], lo[2], fixed_hi[2], hi[2]) == (MiB, 0.0, MiB, 0.0)
    assert all(lo[i] == hi[i] == 32 << 10 and fixed_lo[i] == fixed_hi[i] == 0 for i in (0, 1))
    assert mm.StepModel.build(t16, t32).need(64)["peak_account"] == 4 * MiB + 2 * 64 * (32 << 10) + MiB


def test_the_granule_footprint_counts_a_granule_shared_by_small_blocks_once():
    """Granules of 64 KiB. A block live at the step's start over [4, 5 granules + 100 B) touches
    two; a small block next to it shares the second; a 1 MiB block at 2 MiB + 32 KiB
    touches 17 (a refused request, nothing). Then the first block goes: its second granule
    stays touched by the small block, and two granules more at 10 x 64 KiB make three."""
    g, K = 64 << 10, 1 << 10
    ALLOC, FREE, REFUSE = 0, 1, 2

    def footprint(events, start=((4 * g, g + 100),), granule=g):
        op, size, addr = (np.array([e[i] for e in events]) for i in range(3))
        return _step_trace.granule_footprint([a for a, _ in start], [n for _, n in start], op, size, addr, granule)
    small = (ALLOC, 100, 5 * g + 100)
    assert footprint([small, (ALLOC, MiB, 2 * MiB + 32 * K), (REFUSE, 8 * MiB, 0)]) == (2 + 17) * g
    assert footprint([small, (FREE, g + 100, 4 * g), (ALLOC, 2 * g, 10 * g)]) == 3 * g
    # Not backed on demand: the most bytes live at once.
    assert footprint([small], granule=0) == g + 200


def test_a_step_whose_layout_touched_more_granules_than_the_templates_is_kept_free():
    pool = make_pool()
    t64, t32 = record(pool, 64), record(pool, 32)
    plain = mm.StepModel.build(t64, t32)
    assert plain.spread_bytes == 0
    wider = mm.StepModel.build(t64, t32, layout_bytes=3 * MiB)
    assert wider.spread_bytes == 3 * MiB
    budget = 200 * MiB
    assert wider.largest_fitting(budget) < plain.largest_fitting(budget)
    assert wider.fits(wider.largest_fitting(budget), budget - 3 * MiB + 3 * MiB)
    assert not wider.fits(plain.largest_fitting(budget), budget)


def test_fit_steps_whose_small_blocks_touched_more_granules_than_the_template_widen_the_spread():
    """Two steps at 64 as fit() runs them: A peaks at 3 MiB in one block (the template: the
    highest peak); B makes 64 blocks of 32 KiB, frees every other one (each left alone in
    its 64 KiB granule) and then a 1.5 MiB block: it peaks lower (2.5 MiB) but its live
    blocks touch 3.5 MiB of granules. The model keeps the 0.5 MiB free."""
    from tf_memguard._steps import StepSampler
    pool = make_pool()
    sampler = StepSampler(pool, 64)
    sampler.epoch_begin(0)
    # (Each step's largest block batch-shaped, as a step at its batch size makes them.)
    sampler.step_begin(0, 0)
    pool.free(pool.allocate(MiB, batch=True, kind="kernel"))
    sampler.step_end(0, 0)
    sampler.step_begin(0, 1)
    pool.free(pool.allocate(3 * MiB, batch=True, kind="kernel"))
    sampler.step_end(0, 1)
    sampler.step_begin(0, 2)
    small = [pool.allocate(32 << 10, kind="kernel") for _ in range(64)]
    for a in small[::2]:
        pool.free(a)
    pool.free(pool.allocate(3 * MiB // 2, batch=True, kind="kernel"))
    for a in small[1::2]:
        pool.free(a)
    sampler.step_end(0, 2)
    sampler.train_end()
    assert sampler.template.footprint() == sampler.template_footprint == 7 * MiB   # 4 MiB of weights
    assert sampler.footprint == 7 * MiB + MiB // 2
    assert sampler.layout_bytes() == MiB // 2
    steady = sampler.model().models[0]
    assert steady.spread_bytes == MiB // 2


def test_an_order_met_once_at_the_top_is_kept_free_above_it_and_scales_with_the_batch():
    # Steps alike (same bytes at their start, same batches prepared at their end) that
    # peaked at 216.7, 219.4 (twice) and, once, 223.3 MiB: an order above the highest is
    # taken to lie as far above it as it lies above the next (3.9 MiB). Where the top
    # recurs, it has been met and the template holds it: nothing more.
    from tf_memguard._steps import StepSampler
    pool = make_pool()
    sampler = StepSampler(pool, 150)
    mb = lambda v: int(v * MiB)  # noqa: E731
    sampler._alike = {(1, 2): [mb(216.7), mb(219.4), mb(223.3), mb(219.4)], (5, 6): [mb(40), mb(40)]}
    assert abs(sampler.order_bytes() - mb(3.9)) <= 1
    sampler._alike = {(1, 2): [mb(216.7), mb(223.3), mb(219.4), mb(223.3)]}
    assert sampler.order_bytes() == 0
    # Peaks within one backing granule (64 KiB here) are one order's.
    sampler._alike = {(1, 2): [mb(216.7), mb(223.3), mb(223.3) - 1000, mb(219.4)]}
    assert sampler.order_bytes() == 0
    # Groups of two do not speak: the mixed-precision CNN at 408, two orders 31.6 MiB
    # apart, one of each in every pair.
    sampler._alike = {(mb(40), 10): [mb(149.2), mb(117.6)], (mb(35), 5): [mb(112.8), mb(144.4)]}
    assert sampler.order_bytes() == 0

    m = mm.StepModel.build(record(pool, 8), record(pool, 4), order_bytes=2 * MiB)
    assert m.spread(8) == 2 * MiB and m.spread(4) == 2 * MiB and m.spread(16) == 4 * MiB
    # A model recorded at another size (the short fit()'s lone step at 4) scales the gap
    # from the size it was measured at (8), not from its own.
    lone = mm.StepModel.build(record(pool, 4), record(pool, 8), order_bytes=2 * MiB, order_batch=8)
    assert lone.base_batch == 4 and lone.spread(8) == 2 * MiB and lone.spread(16) == 4 * MiB
    assert mm.StepModel.from_dict(lone.to_dict()).spread(16) == 4 * MiB
    plain = mm.StepModel.build(record(pool, 8), record(pool, 4))
    budget = 64 * MiB
    assert m.largest_fitting(budget) < plain.largest_fitting(budget)
    # Saved and loaded, the model keeps it.
    assert mm.StepModel.from_dict(json.loads(json.dumps(m.to_dict()))).spread(16) == 4 * MiB


def untagged_step(pool, b, weights):
    """A step as PyTorch's glue records it (no batch tags): four activations of b/2 MiB
    live together, then one gradient per weight, all freed."""
    acts = [pool.allocate(b * MiB // 2, kind="other") for _ in range(4)]
    grads = [pool.allocate(w, kind="other") for w in weights]
    for a in grads + acts:
        pool.free(a)


def test_a_block_at_the_start_with_an_activations_size_does_not_make_them_fixed():
    # Weights of 1.25 and 0.75 MiB, and a 2 MiB block live at the start that is no weight
    # (a workspace left from an earlier run): at b=4 the activations are 2 MiB too. Taken
    # as copies of a weight, all four would be fixed and the model would name about four
    # times the size that fits.
    weights = [5 * MiB // 4, 3 * MiB // 4]
    budget = 120 * MiB

    def largest(extra):
        pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
        for w in weights + extra:
            pool.allocate(w, kind="other")
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        untagged_step(pool, 4, weights)
        pool.trace_start(0)
        return mm.StepModel.build(_step_trace.StepTrace.from_pool(pool, live, 4), None).largest_fitting(budget)

    def truth(extra):  # 4 activations of b/2 MiB and the gradients beside what is live
        return int((budget - 2 * sum(weights) - sum(extra)) / (2 * MiB))

    plain, left = largest([]), largest([2 * MiB])
    assert plain <= truth([])
    # One of the four may pass for a weight's copy (the weights' share: one per block),
    # not all four: at most a third above the truth, where all four fixed named 4x.
    assert left <= truth([2 * MiB]) * 4 // 3, (left, truth([2 * MiB]))
    assert left >= plain // 2


def test_the_h200_step_after_an_oom_is_modelled_like_the_fresh_one():
    # Real steps at 32 of Keras on PyTorch on the H200 (benchmarks/data/torch_find_steps.json):
    # after an OOM and its retry, a 16 MiB block live at the step's start had the size of
    # 13 of its activations; all taken as fixed, the step's one-size model named 408,
    # which ran out (197 is the largest that trains, bisection over fresh runs).
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "data", "torch_find_steps.json")
    with open(path) as f:
        saved = json.load(f)
    budget, limit = saved["budget"], 197
    for key in ("fresh_first", "after_oom_first"):
        answer = mm.StepModel.build(_step_trace.StepTrace.from_dict(saved[key]), None).largest_fitting(budget, at_most=20480)
        assert 0.85 * limit <= answer <= limit + 1, (key, answer)


def test_on_kerass_torch_backend_a_model_keeps_room_for_two_earlier_batches(monkeypatch):
    # Keras' torch backend makes each batch on the GPU as it fetches it, and Python can
    # hold the ones before it (benchmarks/NOTES.md, "Batches the cycle collector holds"):
    # a short run's step can begin without them, an epoch's steps meet up to two.
    from tf_memguard import _backend, _core, _recording
    x = np.zeros((100, 8, 8, 3), np.float32)
    y = np.zeros((100,), np.int64)
    per_sample = 8 * 8 * 3 * 4 + 8
    monkeypatch.setattr(_backend, "framework", lambda: "torch")
    sizes, flags = _recording.stale_batches(x, y, 10)
    assert sizes == [_recording.STALE_BATCHES * 10 * per_sample] and _recording.STALE_BATCHES == 2
    assert flags == [_core.ALLOC_BATCH]
    # Batch-tagged: the room grows with the batch size in the model.
    pool = make_pool()
    trace = record(pool, 32)
    big = [8 * MiB], [_core.ALLOC_BATCH]
    plain, kept = mm.StepModel.build(trace, None), mm.StepModel.build(trace, None, extra_start=big)
    assert kept.need(64)["peak_account"] - plain.need(64)["peak_account"] >= 16 * MiB
    assert _recording.joined(None, big, None) == big and _recording.joined(None) is None
    monkeypatch.setattr(_backend, "framework", lambda: "tensorflow")
    assert _recording.stale_batches(x, y, 10) is None


def test_a_step_without_blocks_of_its_batch_size_is_not_taken_for_one():
    # fit() shuffles a PyDataset's batches: its short batch can run where a step at the
    # batch size is recorded. Such a step makes no block of that size (TensorFlow's glue
    # tags those whose first dimension is the size profiled): it is neither the first
    # step nor the template, nor one of the alike steps' peaks.
    from tf_memguard._steps import StepSampler
    pool = make_pool()
    sampler = StepSampler(pool, 64)
    sampler.epoch_begin(0)
    sampler.step_begin(0, 0)
    pool.free(pool.allocate(MiB, kind="kernel"))          # a short batch's step: untagged
    sampler.step_end(0, 0)
    assert sampler.first is None and sampler.model() is None
    sampler.step_begin(0, 1)
    pool.free(pool.allocate(2 * MiB, batch=True, kind="kernel"))
    sampler.step_end(0, 1)
    sampler.step_begin(0, 2)
    pool.free(pool.allocate(5 * MiB, kind="kernel"))      # higher, but not a step at 64
    sampler.step_end(0, 2)
    assert sampler.template is not None and sampler.template.carries_batch()
    assert sampler.template_peak < 5 * MiB + 4 * MiB      # (4 MiB of weights)
    assert sum(len(v) for v in sampler._alike.values()) == 1


def test_a_step_recorded_after_the_model_was_read_updates_its_order_gap():
    # The callback reads the model at an epoch's end (the near-budget warning); steps
    # recorded after it must still count: a third alike step, lower than the template
    # met once, makes an order gap the model built before it did not have.
    from tf_memguard._steps import StepSampler
    pool = make_pool()
    sampler = StepSampler(pool, 64)
    sampler.epoch_begin(0)
    for i, mib in enumerate([1, 3, 2, 1]):
        pool.reset_peak()   # the monitor's window, one a step
        sampler.step_begin(0, i)
        pool.free(pool.allocate(mib * MiB, batch=True, kind="kernel"))   # batch-shaped, as a step's are
        sampler.step_end(0, i)
        if i == 2:
            assert sampler.model().models[0].order_bytes == 0   # 3 and 2: fewer than three
    assert sampler.order_bytes() == MiB
    assert sampler.model().models[0].order_bytes == MiB


def test_the_order_whose_peak_grows_fastest_is_modelled_beside_the_highest():
    # The zoo's wide MLP at 174: every process's highest step peaked at 47.39 MiB, mostly
    # in fixed blocks, while other steps' orders had more of the batch live at their peak;
    # the template alone named up to 446 where 348 trains. Step A (the template) peaks at
    # 14 MiB in a fixed 10 MiB block and grows little; step B peaks lower (13 MiB) with its
    # 8 MiB of activations live, and at twice the size would peak at 21: both are modelled.
    from tf_memguard import _recording
    from tf_memguard._steps import StepSampler

    def fixed_then_batch(pool, b):
        pool.free(pool.allocate(10 * MiB, kind="kernel"))
        pool.free(pool.allocate(b * MiB // 4, batch=True, kind="kernel"))

    def batch_with_fixed(pool, b):
        a = pool.allocate(b * MiB, batch=True, kind="kernel")
        pool.free(pool.allocate(MiB, kind="kernel"))
        pool.free(a)

    pool = make_pool()   # 4 MiB of weights
    sampler = StepSampler(pool, 8)
    sampler.epoch_begin(0)
    for i, run in enumerate([fixed_then_batch, fixed_then_batch, batch_with_fixed]):
        pool.reset_peak()
        sampler.step_begin(0, i)   # step 0 is the run's first step, not a candidate
        run(pool, 8)
        sampler.step_end(0, i)
    live = pool.live_blocks()
    pool.trace_start(1 << 16)
    fixed_then_batch(pool, 4)
    batch_with_fixed(pool, 4)
    pool.trace_start(0)
    sampler.other, sampler._model = _step_trace.StepTrace.from_pool(pool, live, 4), None
    assert _recording.scaled_peak(sampler.template, 2.0) == 14 * MiB
    assert _recording.scaled_peak(sampler.steep, 2.0) == 21 * MiB
    models = sampler.model()
    assert len(models.models) == 3   # the template's, the first step's, the steep one's
    budget = 24 * MiB
    template_only = models.models[0].largest_fitting(budget)
    # B at b: 4 + b + 1 MiB, with RUN_SPREAD of its growth and 2% of the budget kept free.
    assert template_only > 40
    assert 14 <= models.largest_fitting(budget) <= 18
    # A step that is both the highest and the steepest makes no second model.
    pool = make_pool()
    sampler = StepSampler(pool, 8)
    sampler.epoch_begin(0)
    for i in range(3):
        sampler.step_begin(0, i)
        batch_with_fixed(pool, 8)
        sampler.step_end(0, i)
    assert sampler.steep is sampler.template and len(sampler.model().models) == 2


def test_after_an_oom_a_model_that_says_the_failed_size_fits_does_not_give_the_answer():
    # The zoo's embedding model at 1,316: steps completed, the next was refused, and the
    # completed steps' model, which said 1,316 fits, named 1,315 (823 trains). Where the
    # model says the failed size fits, the refusal showed it wrong: short runs of its own
    # decide (_after_oom.needs_steps); where it says it does not, its answer stands.
    from tf_memguard._steps import StepSampler

    def sampler_after_oom(budget):
        pool = tf_memguard.Pool(max_bytes=budget, upstream="host_lazy")
        pool.allocate(4 * MiB, kind="kernel")
        x, y = np.zeros((64, 4), np.float32), np.zeros(64, np.float32)
        sampler = StepSampler(pool, 8, n_samples=64, x=x, y=y)
        sampler.epoch_begin(0)
        for i in range(3):
            pool.reset_peak()
            sampler.step_begin(0, i)
            step(pool, 8)          # peaks at 4 + 8 + 3 + 4 = 19 MiB
            sampler.step_end(0, i)
        sampler.step_begin(0, 3)
        a = pool.allocate(MiB, kind="kernel")   # ... and the next step is refused partway
        assert sampler.failed_step() is not None
        pool.free(a)
        return sampler

    shown_wrong = sampler_after_oom(1 << 30)
    assert shown_wrong.model().fits(8, 1 << 30) and _after_oom.needs_steps(shown_wrong)
    budget = int(19.5 * MiB)   # the steps fit, the model (with its margins) says 8 does not
    told = sampler_after_oom(budget)
    assert not told.model().fits(8, budget) and not _after_oom.needs_steps(told)


def test_steps_whose_start_differs_by_less_than_a_granule_are_alike():
    # The mixed-precision CNN at 256: the same two peaks in steps whose start differed by
    # a 4 KiB block; apart, the higher was met once in one group (a 12.9 MiB gap).
    alike = {(36192896, 9440256): [100.38, 113.23, 100.38, 113.23],
             (36196864, 9440256): [100.38, 113.24, 100.38, 100.38],
             (36196864, 6293504): [110.22]}
    peaks = [[int(v * MiB) for v in p] for p in alike.values()]
    alike = {k: p for k, p in zip(alike, peaks)}
    assert mm.order_gap(peaks[1], 64 << 10) > 12 * MiB   # the second group alone
    groups = mm.alike_groups(alike, 64 << 10)
    assert sorted(len(g) for g in groups) == [1, 8]      # other batch bytes: apart
    assert max(mm.order_gap(g, 64 << 10) for g in groups) == 0
    # More than a granule apart, they are not alike.
    assert len(mm.alike_groups({(0, 5): [1, 2, 3], (1 << 20, 5): [1, 2, 3]}, 64 << 10)) == 2


def test_the_order_gap_is_the_highest_peak_met_once_above_the_next():
    # Alike steps' peaks: the highest met once among at least three is how far it lies
    # above the next one down; met twice, or fewer than three steps, nothing is said.
    assert mm.order_gap([10, 11, 10, 15], same=0) == 4
    assert mm.order_gap([10, 15, 15], same=0) == 0
    assert mm.order_gap([10, 15], same=0) == 0
    # Peaks within `same` bytes count as one: 15 and 14.5 are one peak met twice.
    assert mm.order_gap([10, 14.5, 15], same=1) == 0


def ordered_step(pool, b, together):
    """Three activations of b MiB (tagged), `together` of them live at once: the order in
    which a step's kernels ran decides its peak."""
    live = []
    for _ in range(3):
        live.append(pool.allocate(b * MiB, batch=True, kind="kernel"))
        if len(live) == together:
            pool.free(live.pop(0))
    for a in live:
        pool.free(a)


def test_two_steps_in_different_orders_each_scaled_and_the_larger_need_kept():
    # find_batch_size models both recorded steps, each as the template (_find.build): a
    # larger step whose kernels happened to run in a thrifty order says less than an
    # epoch's steps will need.
    pool = make_pool()

    def rec(b, together):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        ordered_step(pool, b, together)
        pool.trace_start(0)
        return _step_trace.StepTrace.from_pool(pool, live, b)
    small, large = rec(8, 3), rec(32, 2)
    thrifty = mm.StepModel.build(large, small)
    both = mm.StepModels([thrifty, mm.StepModel.build(small, large)])
    assert thrifty.need(64)["peak_account"] == (4 + 2 * 64) * MiB
    assert both.need(64)["peak_account"] == (4 + 3 * 64) * MiB
    budget = 200 * MiB
    assert both.largest_fitting(budget) < thrifty.largest_fitting(budget)


def _steps_with_an_extra_weight_sized_block(free_extra):
    """Steps at 16 and 8 of a model whose weight is 2 MiB: activations of 64 KiB a sample,
    one 2 MiB gradient, and at 16 a second 2 MiB block the step at 8 did not make (a
    kernel that allocated where another time it reused its input), freed by the step's end
    or (free_extra=False) still live then, as an optimizer slot is."""
    pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
    pool.allocate(2 * MiB, kind="kernel")  # the weight, live at every step's start
    traces = []
    for b in (16, 8):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        act = pool.allocate(b * 64 * 1024, batch=True, kind="kernel")
        grad = pool.allocate(2 * MiB, kind="kernel")
        extra = pool.allocate(2 * MiB, kind="kernel") if b == 16 else None
        small = pool.allocate(256, kind="kernel") if b == 8 else None
        for a in (act, grad, small) + ((extra,) if free_extra else ()):
            if a:
                pool.free(a)
        pool.trace_start(0)
        traces.append(_step_trace.StepTrace.from_pool(pool, live, b))
        if extra and not free_extra:
            pool.free(extra)
    return traces


def test_a_block_one_step_made_and_the_other_did_not_is_not_read_as_growth():
    # The extra 2 MiB block at 16, paired by rank with the 256 B block at 8, would be a line
    # below the origin: taken as proportional it was 128 KiB a sample, twice the real
    # slope. Not one tensor at two sizes: unmatched, and of the weight's size, a copy.
    t16, t8 = _steps_with_an_extra_weight_sized_block(free_extra=True)
    model = mm.StepModel.build(t16, t8)
    idx = t16.allocations()
    fixed_lo, lo, fixed_hi, hi, _ = _model_build.match(t16, t8, (), t16.start_size)
    sizes = t16.size[idx]
    assert all(hi[k] == 0 and fixed_hi[k] == 2 * MiB for k in np.flatnonzero(sizes == 2 * MiB))
    # The need grows by the activations only: 64 KiB a sample.
    assert model.need(256)["peak_account"] - model.need(16)["peak_account"] == 240 * 64 * 1024


def test_a_weight_sized_block_live_at_the_steps_end_is_state_not_an_activation():
    t16, t8 = _steps_with_an_extra_weight_sized_block(free_extra=False)
    assert list(_model_build.live_at_end(t16)) == [False, False, True]
    fixed_lo, lo, fixed_hi, hi, _ = _model_build.match(t16, t8, (), t16.start_size)
    assert hi[2] == 0 and fixed_hi[2] == 2 * MiB
    # Without a weight of its size it stays bounded on the safe side (proportional above).
    fixed_lo, lo, fixed_hi, hi, _ = _model_build.match(t16, t8, (), [])
    assert hi[2] == 2 * MiB / 16


def test_a_nested_fits_trace_leaves_out_the_batches_the_run_around_it_prepared():
    from tf_memguard import _recording
    pool = tf_memguard.Pool(max_bytes=1 << 30, upstream="host_lazy")
    pool.allocate(2 * MiB, kind="kernel")                 # a weight (untagged): kept
    outer_batch = pool.allocate(16 * 2048, batch=True, kind="kernel")  # the run's, at 16
    outer = pool.live_blocks()
    own = pool.allocate(8 * 2048, batch=True, kind="kernel")           # the nested fit's, at 8
    live = pool.live_blocks()
    pool.trace_start(1 << 10)
    pool.free(pool.allocate(8 * 64 * 1024, batch=True, kind="kernel"))
    pool.trace_start(0)
    t = _step_trace.StepTrace.from_pool(pool, live, 8)
    t.observed_peak = 2 * MiB + 16 * 2048 + 8 * 2048 + 8 * 64 * 1024
    out = _recording.without_outer_batches(t, outer)
    assert sorted(out.start_size.tolist()) == [8 * 2048, 2 * MiB]
    assert out.observed_peak == t.observed_peak - 16 * 2048
    # A block freed and made again at the same place is the nested fit's own: kept.
    assert len(_recording.without_outer_batches(t, {"address": np.array([1]), "size": np.array([32768])}).start_size) == 3
    pool.free(own), pool.free(outer_batch)


def long_ordered_step(pool, b, layers, extra_at=None):
    """A step of `layers` layers in one order (PyTorch's eager steps): each an activation of
    b x 4 KiB x (1 + layer % 7), kept for the backward pass, and a 1 KiB temporary; at layer
    `extra_at` a 3 MiB workspace the step at the other size did not ask for. Then the
    activations are freed, last first."""
    live = pool.live_blocks()
    pool.trace_start(1 << 20)
    acts = []
    for layer in range(layers):
        acts.append(pool.allocate(b * 4096 * (1 + layer % 7), kind="kernel"))
        pool.free(pool.allocate(1024, kind="kernel"))
        if layer == extra_at:
            pool.free(pool.allocate(3 * MiB, kind="kernel"))
    for a in reversed(acts):
        pool.free(a)
    pool.trace_start(0)
    return dataclasses.replace(_step_trace.StepTrace.from_pool(pool, live, b), ordered=True)


def test_long_steps_in_one_order_are_aligned_block_by_block_where_one_asked_for_more():
    # Two steps of 3,000 layers (15,000 events each, about half a step of keras.io's
    # MLP-Mixer on PyTorch) in one order, the larger with a workspace the other lacks:
    # every activation is paired with its own at the other size, so the model scales each
    # exactly. (difflib's alignment took minutes on such steps: find_batch_size on the
    # Mixer never returned.)
    pool = tf_memguard.Pool(max_bytes=1 << 34, upstream="host_lazy")
    layers = 3000
    at32 = long_ordered_step(pool, 32, layers, extra_at=1500)
    at16 = long_ordered_step(pool, 16, layers)
    pairs = dict(_model_build._ordered_pairs(at32, at16))
    sizes32, sizes16 = at32.size[at32.allocations()], at16.size[at16.allocations()]
    acts32 = [k for k, v in enumerate(sizes32.tolist()) if v >= 16 * 4096 and v != 3 * MiB]
    acts16 = [k for k, v in enumerate(sizes16.tolist()) if v >= 16 * 4096]
    assert len(acts32) == len(acts16) == layers
    # Each activation's partner is its own layer's, but for the one beside the workspace
    # (a layer's tokens repeat: which of two alike blocks the workspace pairs with is a
    # tie; difflib, used before, paired it with a temporary, this with the activation,
    # whose line the sizes then rule out: left bounded, scaled as a whole).
    partners = [pairs.get(i) for i in acts32]
    assert sum(p == j for p, j in zip(partners, acts16)) >= layers - 1
    assert all(p is None or p == j for p, j in zip(partners, acts16))
    model = mm.StepModel.build(at32, at16)
    acts = sum(64 * 4096 * (1 + layer % 7) for layer in range(layers))
    assert model.need(64)["peak_account"] == acts + 1024


def test_align_pairs_equal_tokens_around_what_one_side_added_or_changed():
    rng = np.random.default_rng(5)
    a = rng.integers(0, 4, 20000)
    b = np.concatenate([a[:5000], [9, 9, 9], a[5000:12000], a[12004:]])   # 3 added, 4 left out
    b[15000] = 8                                                        # one changed in place
    i, j = _model_build._align(a, b)
    assert (a[i] == b[j]).all() and (np.diff(i) > 0).all() and (np.diff(j) > 0).all()
    truth = dict(zip(range(5000), range(5000)))
    truth.update(zip(range(5000, 12000), range(5003, 12003)))
    truth.update((k, k - 1) for k in range(12004, 20000) if k - 1 != 15000)
    got = dict(zip(i.tolist(), j.tolist()))
    assert sum(got.get(k) == v for k, v in truth.items()) >= len(truth) - 8   # a few ties at the edges


def test_the_size_below_the_budget_after_steps_over_it_lies_on_the_line_through_their_peaks():
    from tf_memguard._overshoot_check import below_budget
    # Steps whose peak is 32 MB fixed plus 0.66 MB a sample (the README's CNN with
    # jit_compile=True: 60.4 MB at 42, 49.9 MB at 26), a budget of 48 MiB (50.3 MB).
    def peak(s):
        return 32_000_000 + 660_000 * s
    budget = 48 * MiB
    largest = max(s for s in range(200) if peak(s) <= budget)   # 27
    # From one step, in proportion: too many (the fixed part), but fewer than the step's.
    one = below_budget([(42, peak(42))], budget)
    assert largest < one < 42
    # From two, on their line: the largest size within the budget, not one more.
    assert below_budget([(42, peak(42)), (one, peak(one))], budget) == largest
    # Peaks that do not rise with the size give no line: the proportion again.
    assert below_budget([(42, peak(30)), (30, peak(30))], budget) == 30 * budget // peak(30)


def test_the_bytes_of_a_kind_live_at_a_steps_start_are_counted():
    pool = tf_memguard.Pool(max_bytes=64 * MiB, upstream="host_lazy")
    a = pool.allocate(3 * MiB, kind="input")
    b = pool.allocate(1 * MiB, kind="kernel")
    live = _step_trace.StepTrace.capture_start(pool)
    pool.trace_start(1 << 16)
    step(pool, 2)
    t = _step_trace.StepTrace.from_pool(pool, live, 2)
    pool.trace_start(0)
    assert t.start_bytes("input") == 3 * MiB and t.start_bytes("kernel") == 1 * MiB and t.start_bytes("xla") == 0
    pool.free(a)
    pool.free(b)


def test_a_fit_builds_leftovers_are_kept_in_every_model_in_proportion_to_the_batch():
    # Keras' torch backend builds a model at its first fit() on the GPU where a layer
    # cannot run on PyTorch's "meta" device, at the first batch's shape, and leaves what
    # that made to the cycle collector: a fresh fit() meets it in its first steps
    # (keras_hub's Qwen3 at 113 ran out where the run's own steps, without it, fitted).
    # MemGuardCallback collects it as its fit() begins; its bytes per sample go into the
    # models, proportional to the batch size asked about (_recording.build_garbage_rate).
    from tf_memguard import _recording
    from tf_memguard._steps import StepSampler
    def models(rate):
        pool = make_pool()
        sampler = StepSampler(pool, 64)
        sampler.garbage_per_sample = rate   # as MemGuardCallback sets it, at the fit()'s start
        sampler.epoch_begin(0)
        for i in range(3):
            sampler.step_begin(0, i)
            step(pool, 64)
            sampler.step_end(0, i)
        return sampler.model()

    rate = 0.75 * MiB                       # what gc.collect() freed at 64, over 64
    without, with_it = models(0.0), models(rate)
    assert len(with_it.models) == len(without.models) >= 2   # the template and the first step
    for b in (16, 64, 128):
        for a, w in zip(without.models, with_it.models):
            if a is not None:
                assert w.need(b)["peak_account"] == a.need(b)["peak_account"] + int(rate * b), b
    budget = 400 * MiB
    assert with_it.largest_fitting(budget) < without.largest_fitting(budget)
    # Saved with the model (the report's what-if answers the same).
    back = mm.StepModels.from_dict(json.loads(json.dumps(with_it.to_dict())))
    assert back.need(100) == with_it.need(100)


def test_after_an_oom_the_report_names_the_size_for_a_fresh_process_apart():
    # The answer after an OOM is for the retry in this process, whose model is built: a
    # fresh process's first fit() also holds what Keras' build left (keras_hub's Qwen3:
    # 121 trained after the OOM, 111 is the most that trains in a fresh process). The
    # method says the size for a fresh process where that is less.
    from tf_memguard._steps import StepSampler

    def sampler_after_oom(rate, answer):
        pool = make_pool()
        sampler = StepSampler(pool, 64)
        sampler.garbage_per_sample = rate
        sampler.epoch_begin(0)
        for i in range(3):
            sampler.step_begin(0, i)
            step(pool, 64)
            sampler.step_end(0, i)
        # As model_after_oom leaves it: the model the short runs made, the sizes that
        # completed, the answer as the cap.
        sampler.use_model(mm.StepModels([mm.StepModel.build(sampler.template, None)]))
        sampler.b0, sampler.after_oom, sampler.too_large, sampler.cap = 900, [450, answer], 900, answer
        return sampler
    without = sampler_after_oom(0.0, 600)
    assert without.fresh_process_size() is None and "fresh process" not in without.method()
    rate = 0.75 * MiB
    s = sampler_after_oom(rate, 600)
    fresh = s.fresh_process_size()
    plain = s.model().largest_fitting(1 << 30)
    assert plain >= 600 > fresh > 0
    with_build = mm.StepModels([m.with_shortfall(rate, 0) for m in s.model().models])
    assert with_build.fits(fresh, 1 << 30) and not with_build.fits(fresh + 1, 1 << 30)
    assert f"{fresh} there" in s.method() and "768 KiB a sample" in s.method(), s.method()
    assert sampler_after_oom(rate, 100).fresh_process_size() is None   # fits there too: nothing to add


def test_the_builds_leftovers_per_sample_are_kept_for_the_models_next_fit():
    # A fit() of a model already built builds nothing, so collects nothing: the rate its
    # first fit() measured still holds for a fresh process's first fit().
    from tf_memguard import _recording

    class Model:   # any object a Keras model is: the rate is kept as an attribute of it
        pass
    m = Model()
    assert _recording.build_garbage_rate(m, 0, 64) == 0.0
    assert _recording.build_garbage_rate(m, 64 * MiB, 64) == MiB       # the first fit(), at 64
    assert _recording.build_garbage_rate(m, 0, 128) == MiB             # built: nothing freed
    assert _recording.build_garbage_rate(m, 256 * MiB, 128) == 2 * MiB  # more: the most measured
    assert _recording.build_garbage_rate(None, 32 * MiB, 64) == 0.5 * MiB
    assert _recording.garbage_at(0.0, 64) is None
    assert _recording.garbage_at(MiB, 64) == ([64 * MiB], [_recording.SHORTFALL_FLAGS])
    # On the TensorFlow backend nothing is collected at a fit()'s start.
    pool = make_pool()
    assert _recording.collect_build_garbage(pool) == 0


def test_state_a_first_step_made_once_and_the_steady_steps_begin_with_is_fixed():
    # Keras' torch backend: cuBLAS makes a 32 MiB workspace in a fit()'s first step and keeps
    # it; no step at another size makes one, so alone it is bounded (proportional above the
    # recorded size). The steady step at the same size begins with it: state, fixed there
    # and so in the first step's model too.
    pool = make_pool()

    def rec(b, workspace=False):
        live = pool.live_blocks()
        pool.trace_start(1 << 16)
        act = pool.allocate(b * MiB, kind="other")
        ws = pool.allocate(32 * MiB, kind="other") if workspace else None
        pool.free(act)
        pool.trace_start(0)
        return dataclasses.replace(_step_trace.StepTrace.from_pool(pool, live, b), ordered=True), ws

    first, ws = rec(16, workspace=True)
    steady, _ = rec(16)
    other, _ = rec(8)
    fresh = 4 + 32 + 128   # weights, the workspace, a step's activations at 128 (MiB)
    assert mm.StepModel.build(first, other, first=True, steady=steady).need(128)["peak_account"] == fresh * MiB
    assert mm.StepModel.build(first, other, first=True).need(128)["peak_account"] == (4 + 32 * 8 + 128) * MiB
    # A block the first step kept and freed before the steady steps began is not state:
    # still bounded.
    pool.free(ws)
    later, _ = rec(16)
    assert mm.StepModel.build(first, other, first=True, steady=later).need(128)["peak_account"] \
        == (4 + 32 * 8 + 128) * MiB


def test_of_an_order_gap_no_more_grows_with_the_batch_than_the_steps_proportional_bytes_live_at_once():
    # The step at 8: 8 MiB of activations and 4 MiB untagged, both proportional, and a fixed
    # 3 MiB workspace, all live at once: an order can move at most 12 MiB that grow with the
    # batch. A 20 MiB gap (a CNN recorded at a batch of 1 met one step 12 MiB above the
    # others, and scaled whole the gap named 4 where 121 trains) is 8 MiB of fixed blocks.
    pool = make_pool()
    m = mm.StepModel.build(record(pool, 8), record(pool, 4), order_bytes=20 * MiB)
    assert m.moving_bytes(8) == 12 * MiB
    assert m.spread(8) == 20 * MiB and m.spread(16) == (20 + 12) * MiB and m.spread(32) == (20 + 3 * 12) * MiB
    # A gap under the proportional bytes scales whole, as before.
    small = mm.StepModel.build(record(pool, 8), record(pool, 4), order_bytes=2 * MiB)
    assert small.spread(16) == 4 * MiB
