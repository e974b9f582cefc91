"""The batch-size advice on a zoo of models (benchmarks/zoo.py), against real runs.

For each model, under its budget (zoo.BUDGETS):
- limit: the largest batch size that trains two epochs over the whole data set in 2 of 2
  fresh processes (bisection over real runs, to within 2%);
- advice: MemGuardCallback's suggestion after two epochs at about half the limit, and
  whether it trains two epochs in 2 of 2 fresh processes;
- after an OOM: a fit() at 1.6x the limit runs out; the suggestion in its explained error,
  and whether a retry at it in the same process trains two epochs;
- find_batch_size (4 steps), and whether its answer trains two epochs;
- the advice again after two epochs at the largest power of two at most half the limit
  that divides the samples (as a user's batch size often does): those steps run the trace
  with a known batch dimension, and the model of the other sizes comes from a short fit()
  (benchmarks/NOTES.md, "At a batch size that divides the samples").
Prints a table and writes benchmarks/results/advice_zoo.json. Slow (about 40 minutes on 2
cores): every row is a dozen fresh processes or more; with --limits (the limits of an
earlier run, which do not depend on the advice) five per row.

    python benchmarks/advice_zoo.py [--models resnet,gru] [--out benchmarks/results/advice_zoo.json]
                                    [--limits benchmarks/results/advice_zoo.json] [--limits-only]
                                    [--limits-without-waits FILE]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

PRELUDE = f"""
import os, sys, json, gc, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, {HERE!r})
import tf_memguard
def emit(**kw):
    print(json.dumps(kw), flush=True)
def lr_of(m):
    import keras
    return float(keras.ops.convert_to_numpy(m.optimizer.learning_rate))
"""

FIT = PRELUDE + """
from zoo import build
tf_memguard.install(max_bytes={budget} << 20)
import tensorflow as tf
x, y, make = build({name!r})
m = make()
cb = tf_memguard.MemGuardCallback(verbose=0)
try:
    m.fit(x, y, batch_size={batch}, epochs=2, verbose=0, callbacks=[cb])
    rep = tf_memguard.report()
    t0 = time.time()
    suggested = rep.suggested_batch_size  # a size above the run's is confirmed by a step at it when read
    emit(fits=True, suggested=suggested, peak=rep.peak_bytes, method=rep.suggestion_method,
         read_seconds=round(time.time() - t0, 2))
except tf.errors.ResourceExhaustedError as e:
    emit(fits=False)
"""

OOM = PRELUDE + """
from zoo import build
tf_memguard.install(max_bytes={budget} << 20)
import tensorflow as tf
x, y, make = build({name!r})
m = make()
lr0 = lr_of(m)
cb = tf_memguard.MemGuardCallback(verbose=0)
note = None
try:
    m.fit(x, y, batch_size={batch}, epochs=2, verbose=0, callbacks=[cb])
except tf.errors.ResourceExhaustedError as e:
    note = "\\n".join(getattr(e, "__notes__", []))
if note is None:
    emit(oom=False)
else:
    # The retry comes after the except block, as the README says: while an exception is
    # handled, it holds the failed fit()'s frames, and with them its copy of the data.
    gc.collect()
    rep = tf_memguard.report()
    size, method = rep.suggested_batch_size, rep.suggestion_method
    lr_intact = lr_of(m) == lr0  # the short runs left the optimizer as it was
    try:
        m.fit(x, y, batch_size=size, epochs=2, verbose=0, callbacks=[cb])
        retry = True
    except tf.errors.ResourceExhaustedError:
        retry = False
    emit(oom=True, suggested=size, retry_trained=retry, note=note[:600], method=method, lr_intact=lr_intact)
"""

FIND = PRELUDE + """
from zoo import build
tf_memguard.install(max_bytes={budget} << 20)
import tensorflow as tf
x, y, make = build({name!r})
m = make()
lr0 = lr_of(m)
size = tf_memguard.find_batch_size(m, x, y)
lr_intact = lr_of(m) == lr0 and int(m.optimizer.iterations.numpy()) == 0
try:
    m.fit(x, y, batch_size=size, epochs=2, verbose=0)
    trained = True
except tf.errors.ResourceExhaustedError:
    trained = False
emit(size=size, trained=trained, lr_intact=lr_intact)
"""


def run(code, timeout=1200):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"rc={proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


class Trials:
    """Fresh-process fits of one model, cached by batch size."""

    def __init__(self, name, budget):
        self.name, self.budget = name, budget
        self.cache = {}
        self.runs = 0

    def fits(self, batch, repeats=2):
        got = self.cache.setdefault(batch, [])
        while len(got) < repeats and all(r["fits"] for r in got):
            got.append(run(FIT.format(name=self.name, budget=self.budget, batch=batch)))
            self.runs += 1
        return all(r["fits"] for r in got[:repeats])

    def limit(self, guess):
        """The largest batch size that trains in 2 of 2 runs, to within 2% (0: none)."""
        b = max(2, guess)
        if self.fits(b):
            lo, hi = b, None
            while hi is None:
                b = int(b * 1.25) + 1
                lo, hi = (b, None) if self.fits(b) else (lo, b)
        else:
            lo, hi = None, b
            while lo is None:
                b = max(1, int(b / 1.25))
                if self.fits(b):
                    lo = b
                elif b == 1:
                    return 0
                else:
                    hi = b
        while hi - lo > max(1, lo // 50):
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid) else (lo, mid)
        return lo


def samples_of(name):
    """The samples the zoo's model `name` is trained on (its builder's default)."""
    import inspect
    from zoo import ZOO
    return inspect.signature(ZOO[name]).parameters["n"].default


def divisor_batch(n, limit):
    """The largest power of two at most half `limit` that divides `n` (1 at least)."""
    b = 1
    while b * 2 <= max(1, limit // 2) and n % (b * 2) == 0:
        b *= 2
    return b


def evaluate(name, budget, known=None, limit_only=False, nowait=None, keep=None, keep_find=None):
    """The row of model `name`; `known`: its limit from an earlier run (no bisection);
    `limit_only`: the limit alone (its bisection's runs kept); `nowait`: its limit with
    install(wait=0), from an earlier run, for the ratios against it too; `keep`: its row of an
    earlier run, whose advice columns are kept; `keep_find`: its row of an earlier run, whose
    find_batch_size column is kept."""
    t0 = time.time()
    trials = Trials(name, budget)
    if known:
        limit = known
    else:
        probe = run(FIT.format(name=name, budget=budget, batch=32))
        guess = probe.get("suggested") or 64
        limit = trials.limit(guess)
    if limit_only:
        return {"model": name, "budget_mib": budget, "limit": limit, "fit_runs": trials.runs,
                "bisection": {str(b): [r["fits"] for r in got] for b, got in sorted(trials.cache.items())},
                "seconds": round(time.time() - t0, 1)}
    half = max(1, limit // 2)
    div = divisor_batch(samples_of(name), limit)
    if keep:
        # The advice's columns of an earlier run (--keep-advice): only the answers after an
        # OOM and find_batch_size's are measured again.
        suggested, trains = keep["suggested"], keep["suggested_trains_2_of_2"]
        suggested_div, trains_div = keep["divisor_suggested"], keep["divisor_suggested_trains_2_of_2"]
    else:
        advised = run(FIT.format(name=name, budget=budget, batch=half))
        suggested = advised.get("suggested") if advised["fits"] else None
        trains = bool(suggested) and trials.fits(suggested)
    oom = run(OOM.format(name=name, budget=budget, batch=int(limit * 1.6)))
    if keep_find:
        find = {"size": keep_find["find_batch_size"], "trained": keep_find["find_trained"],
                "lr_intact": keep_find.get("find_lr_intact")}
    else:
        find = run(FIND.format(name=name, budget=budget))
    if not keep:
        advised_div = run(FIT.format(name=name, budget=budget, batch=div))
        suggested_div = advised_div.get("suggested") if advised_div["fits"] else None
        trains_div = bool(suggested_div) and trials.fits(suggested_div)
    row = {
        "model": name, "budget_mib": budget, "limit": limit,
        "suggested": suggested, "suggested_over_limit": round(suggested / limit, 3) if suggested else None,
        "suggested_trains_2_of_2": trains, "advised_run_batch": half,
        "oom_batch": int(limit * 1.6), "oom_raised": oom["oom"], "after_oom_suggested": oom.get("suggested"),
        "after_oom_over_limit": round(oom["suggested"] / limit, 3) if oom.get("suggested") else None,
        "after_oom_retry_trained": oom.get("retry_trained"), "oom_note": oom.get("note"),
        "after_oom_method": oom.get("method"),
        "find_batch_size": find["size"], "find_over_limit": round(find["size"] / limit, 3),
        "find_trained": find["trained"], "after_oom_lr_intact": oom.get("lr_intact"),
        "find_lr_intact": find.get("lr_intact"), "divisor_run_batch": div, "divisor_suggested": suggested_div,
        "divisor_over_limit": round(suggested_div / limit, 3) if suggested_div else None,
        "divisor_suggested_trains_2_of_2": trains_div, "fit_runs": trials.runs, "seconds": round(time.time() - t0, 1),
    }
    if known:
        row["limit_from"] = "an earlier run's bisection (--limits)"
    if keep:
        row["advice_from"] = "an earlier run's (--keep-advice): the advice and at-2^k columns"
    if keep_find:
        row["find_from"] = "an earlier run's (--keep-find): the find_batch_size column"
    if not keep:
        row["suggestion_method"] = advised.get("method")
        row["divisor_suggestion_method"] = advised_div.get("method")
    if nowait:
        # The memory model is of the step as it runs without waits: its answers against
        # the largest size that trains with install(wait=0) too (NOTES, "Waiting for frees").
        row["limit_without_waits"] = nowait
        for key in ("suggested", "after_oom_suggested", "find_batch_size", "divisor_suggested"):
            name_ = {"suggested": "suggested", "after_oom_suggested": "after_oom",
                     "find_batch_size": "find", "divisor_suggested": "divisor"}[key]
            row[f"{name_}_over_limit_without_waits"] = round(row[key] / nowait, 3) if row.get(key) else None
    return row


def table(rows):
    head = (f"{'model':<16}{'budget':>8}{'limit':>7}{'advice':>8}{'ratio':>7}{'trains':>8}{'OOM->':>7}"
            f"{'ratio':>7}{'retry':>7}{'find':>6}{'ratio':>7}{'trains':>8}{'at 2^k':>7}{'advice':>7}{'ratio':>7}"
            f"{'trains':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['model']:<16}{r['budget_mib']:>6}Mi{r['limit']:>7}{str(r['suggested']):>8}"
                     f"{str(r['suggested_over_limit']):>7}{str(r['suggested_trains_2_of_2']):>8}"
                     f"{str(r['after_oom_suggested']):>7}{str(r['after_oom_over_limit']):>7}"
                     f"{str(r['after_oom_retry_trained']):>7}{r['find_batch_size']:>6}{r['find_over_limit']:>7}"
                     f"{str(r['find_trained']):>8}{str(r.get('divisor_run_batch')):>7}"
                     f"{str(r.get('divisor_suggested')):>7}{str(r.get('divisor_over_limit')):>7}"
                     f"{str(r.get('divisor_suggested_trains_2_of_2')):>8}")
    if any(r.get("limit_without_waits") for r in rows):
        lines.append("")
        lines.append(f"{'against the limit without waits':<34}{'limit':>7}{'advice':>8}{'OOM->':>8}{'find':>8}{'at 2^k':>8}")
        for r in rows:
            if r.get("limit_without_waits"):
                lines.append(f"{r['model']:<34}{r['limit_without_waits']:>7}"
                             + "".join(f"{str(r.get(k + '_over_limit_without_waits')):>8}"
                                       for k in ("suggested", "after_oom", "find", "divisor")))
    checked = [r for r in rows if r.get("find_lr_intact") is not None]
    if checked:
        intact = sum(bool(r["find_lr_intact"]) for r in checked) + sum(bool(r.get("after_oom_lr_intact"))
                                                                     for r in checked)
        lines.append(f"optimizer left as it was (learning rate; iterations after find_batch_size): "
                     f"{intact} of {2 * len(checked)} (after an OOM, find_batch_size)")
    ratios = [r["suggested_over_limit"] for r in rows if r["suggested_over_limit"]]
    if ratios:
        lines.append(f"advice/limit: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}; "
                     f"after OOM min {min(r['after_oom_over_limit'] or 0 for r in rows):.3f}; "
                     f"find_batch_size min {min(r['find_over_limit'] for r in rows):.3f}")
    return "\n".join(lines)


def main(argv=None):
    sys.path.insert(0, HERE)
    from zoo import BUDGETS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(BUDGETS), help="comma-separated zoo names. Defaults to all.")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "advice_zoo.json"))
    ap.add_argument("--limits", default=None,
                    help="a JSON written by this script: take each model's limit from it instead of bisecting "
                         "(the limit depends on the model and the pool, not on the advice)")
    ap.add_argument("--limits-without-waits", default=None,
                    help="a JSON written by this script with limits measured under install(wait=0) (or before "
                         "requests waited): each answer's ratio to that limit too")
    ap.add_argument("--keep-advice", default=None,
                    help="a JSON written by this script: keep its advice columns (after two epochs at half the "
                         "limit, and at a power of two) and measure the rest again")
    ap.add_argument("--keep-find", default=None,
                    help="a JSON written by this script: keep its find_batch_size column and measure the "
                         "others again")
    ap.add_argument("--limits-only", action="store_true",
                    help="bisect each model's limit and stop there (rows of model, budget and limit, for --limits)")
    args = ap.parse_args(argv)
    known, nowait = {}, {}
    if args.limits:
        with open(args.limits) as f:
            known = {r["model"]: r["limit"] for r in json.load(f)["rows"]}
    kept = {}
    if args.keep_advice:
        with open(args.keep_advice) as f:
            kept = {r["model"]: r for r in json.load(f)["rows"]}
    kept_find = {}
    if args.keep_find:
        with open(args.keep_find) as f:
            kept_find = {r["model"]: r for r in json.load(f)["rows"]}
    if args.limits_without_waits:
        with open(args.limits_without_waits) as f:
            nowait = {r["model"]: r["limit"] for r in json.load(f)["rows"]}
    rows = []
    for name in args.models.split(","):
        row = evaluate(name, BUDGETS[name], known.get(name), limit_only=args.limits_only, nowait=nowait.get(name),
                       keep=kept.get(name), keep_find=kept_find.get(name))
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "epochs": 2, "repeats": 2}, f, indent=2)
    if args.limits_only:
        for r in rows:
            print(f"{r['model']:<16}{r['budget_mib']:>6} MiB  limit {r['limit']:>5}  ({r['fit_runs']} runs, {r['seconds']} s)")
    else:
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
