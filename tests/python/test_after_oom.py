"""How the answer after an out-of-memory error is settled (tf_memguard._after_oom.settle):
which short runs and confirmations it asks for, and the size it names. The runs' outcomes
are given as the largest size at which each kind of run completes, as the zoo's models
showed them; the runs themselves are tested in test_advice."""
from tf_memguard import _after_oom


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
