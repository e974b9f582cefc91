"""How the answer after an out-of-memory error is settled (tf_memguard._after_oom.settle):
which short runs and confirmations it asks for, and the size it names; and the first short
runs, after an OOM (_after_oom.descend) and in find_batch_size (_find.first_step), with
waits where none completes without. The runs' outcomes
are given as the largest size at which each kind of run completes, as the zoo's models
showed them; the runs themselves are tested in test_advice."""
import types

from tf_memguard import _after_oom, _find


class Runs:
    """Short runs complete at sizes up to `short`, confirmations (longer runs) up to
    `long`; every call is kept."""

    def __init__(self, short, long):
        self.short, self.long, self.calls = short, long, []

    def run_at(self, size):
        self.calls.append(("run", size))
        return size <= self.short

    def confirm(self, size):
        self.calls.append(("confirm", size))
        return size <= self.long


def test_failed_confirmations_go_on_as_a_bisection_below_them():
    # The zoo's mixed-precision CNN after an OOM at 1,307 (817 trains): short runs at 653,
    # 1,024 and 1,045 completed, both confirmations ran out; the answer was 653 (0.80).
    runs = Runs(short=1045, long=800)
    answer, too_large = _after_oom.settle(653, [1024, 1045], 1307, runs.run_at, runs.confirm)
    assert runs.calls[0] == ("confirm", 1045)
    assert 745 <= answer <= 800, runs.calls
    assert answer < too_large <= 1024
    assert len(runs.calls) <= _after_oom.CONFIRM_RUNS
    assert ("confirm", answer) in runs.calls


def test_a_size_too_near_a_refused_one_is_not_the_answer():
    # The zoo's ResNet after an OOM at 481 (301 trains): 304 completed a short run and
    # four steps, 306 was refused, and the retry at 304 ran out.
    runs = Runs(short=305, long=305)
    answer, too_large = _after_oom.settle(240, [304], 306, runs.run_at, runs.confirm)
    assert ("confirm", 304) not in runs.calls
    assert 240 < answer <= 306 / (1 + _after_oom.RUN_SPREAD), runs.calls
    assert ("confirm", answer) in runs.calls


def test_the_answer_is_confirmed_and_at_least_the_spread_below_every_refusal():
    runs = Runs(short=2000, long=1030)
    answer, too_large = _after_oom.settle(653, [900, 1024, 1045], 1307, runs.run_at, runs.confirm)
    assert runs.calls[:2] == [("confirm", 1045), ("confirm", 900)]   # 1,024 is too near 1,045
    assert too_large == 1045
    assert 900 < answer <= 1045 / (1 + _after_oom.RUN_SPREAD), runs.calls
    assert ("confirm", answer) in runs.calls


def test_a_refused_size_above_the_first_leads_to_a_size_halfway():
    # keras.io's text CNN after an OOM at 422 (264 trains): 211 completed, the ascent's
    # sizes were refused; the answer was 211 (0.80).
    runs = Runs(short=264, long=264)
    answer, too_large = _after_oom.settle(211, [], 262, runs.run_at, runs.confirm)
    assert runs.calls[0] == ("run", 236)
    assert answer >= 236 and too_large == 262


def test_no_run_where_the_first_size_lies_within_the_spread_of_a_refused_one():
    runs = Runs(short=10_000, long=10_000)
    first = 1600
    answer, too_large = _after_oom.settle(first, [], int(first * (1 + _after_oom.RUN_SPREAD)), runs.run_at,
                                          runs.confirm)
    assert (answer, runs.calls) == (first, [])


def test_the_runs_are_bounded_and_the_first_size_stays_the_floor():
    runs = Runs(short=0, long=0)   # nothing above the first completes
    answer, too_large = _after_oom.settle(100, [150, 180, 190], 200, runs.run_at, runs.confirm, runs=4)
    assert answer == 100
    assert len(runs.calls) == 4
    assert too_large <= 150


class Descent:
    """Short runs that complete at sizes up to `plain` without waits and up to `waiting`
    with them (0: none); every call is kept."""

    def __init__(self, plain, waiting):
        self.plain, self.waiting, self.calls = plain, waiting, []

    def run_at(self, size, waits):
        self.calls.append((size, waits))
        return size if size <= (self.waiting if waits else self.plain) else None


def test_the_descent_stops_at_the_first_size_that_completes_without_waits():
    runs = Descent(plain=40, waiting=200)
    good, refused, waits = _after_oom.descend(256, 1 << 62, runs.run_at, can_wait=True)
    assert (good, refused, waits) == (32, 128, False)
    assert runs.calls == [(128, False), (32, False)]


def test_where_no_size_completes_without_waits_the_descent_is_run_again_with_them():
    # An embedding and two Conv1D over 600 tokens under 40 MiB, refused at 64: two of
    # TensorFlow's 24.6 MB convolution workspaces met in some short runs whatever the batch
    # size, every size down to 1 was refused, and the advice named 0 where 8 to 17 train.
    runs = Descent(plain=0, waiting=17)
    good, refused, waits = _after_oom.descend(64, 64, runs.run_at, can_wait=True)
    assert (good, refused, waits) == (8, 32, True)
    assert runs.calls == [(32, False), (8, False), (2, False), (1, False), (32, True), (8, True)]


def test_without_waits_to_fall_back_on_the_descent_ends_with_none():
    runs = Descent(plain=0, waiting=17)
    assert _after_oom.descend(64, 64, runs.run_at, can_wait=False) == (None, 1, False)
    assert runs.calls == [(32, False), (8, False), (2, False), (1, False)]
    # Nor with waits: none, and a batch of 1 refused.
    runs = Descent(plain=0, waiting=0)
    assert _after_oom.descend(64, 64, runs.run_at, can_wait=True) == (None, 1, True)
    assert len(runs.calls) == 8


def test_the_descent_skips_sizes_known_refused():
    runs = Descent(plain=0, waiting=17)
    good, refused, waits = _after_oom.descend(1024, 100, runs.run_at, can_wait=True)
    # 512 and 128 lie above the 100 known refused: 32, 8, 2, 1 without waits, then 32, 8.
    assert runs.calls[0] == (32, False) and (8, True) in runs.calls and (good, waits) == (8, True)
    assert refused == 32


def test_find_batch_size_halves_its_default_start_then_tries_again_with_waits():
    def run_at(size, waits):
        calls.append((size, waits))
        return types.SimpleNamespace(complete=size <= (12 if waits else 0))
    calls = []
    trace, size, refused, waits = _find.first_step(32, True, run_at, can_wait=True)
    assert (trace.complete, size, refused, waits) == (True, 8, 16, True)
    assert calls == [(32, False), (16, False), (8, False), (4, False), (2, False), (1, False),
                     (32, True), (16, True), (8, True)]
    # A start of the user's is not halved; where it completes without waits, none are tried.
    calls = []
    trace, size, refused, waits = _find.first_step(10, False, run_at, can_wait=True)
    assert (trace.complete, size, refused, waits) == (True, 10, None, True) and calls == [(10, False), (10, True)]
    calls = []
    trace, size, refused, waits = _find.first_step(32, True, run_at, can_wait=False)
    assert (trace.complete, size, refused, waits) == (False, 1, 2, False) and len(calls) == 6
    calls = []
    assert _find.first_step(8, True, lambda b, w: types.SimpleNamespace(complete=True), True)[1:] == (8, None, False)
