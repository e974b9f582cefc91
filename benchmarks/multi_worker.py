"""What the merged report of a multi-worker run costs, measured at 2-4 CPU workers on this
machine and extended to 64 (MultiWorkerMirroredStrategy, examples/multi_worker.py).

Per run: each epoch's all-gather as the last worker to arrive waited for it (the smallest
gather_seconds across the workers: the others' waits include their lead on it), the
report's per-worker section in JSON (bytes), and the epoch time. The gather moves 6
float64 numbers a worker (48 bytes) and its cost grows with the workers' count through
the collective's ring; the section grows by one entry a worker and epoch. Both are fitted
as a line in the workers' count and read at 64.

    python benchmarks/multi_worker.py [--workers 2,3,4] [--epochs 3]

Writes benchmarks/results/multi_worker.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(n, epochs, samples):
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multi_worker.py"), "--workers", str(n),
                               "--epochs", str(epochs), "--samples", str(samples), "--budget", "256MiB",
                               "--out", out, "--timeout", "900"], capture_output=True, text=True, timeout=1000)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"{n} workers: exit {proc.returncode}\n{proc.stdout[-3000:]}")
        reports = [json.load(open(os.path.join(out, f"worker-{i}.json"))) for i in range(n)]
    epochs_ = reports[0]["cluster"]["epochs"]
    last_arrival = [min(r["cluster"]["epochs"][e]["gather_seconds"] for r in reports) for e in range(len(epochs_))]
    section = len(json.dumps(reports[0]["cluster"]))
    epoch_seconds = statistics.median(e["seconds"] for r in reports for e in r["epochs"][1:] or r["epochs"])
    return {"workers": n, "gather_seconds_last_arrival": last_arrival,
            "gather_seconds_median": statistics.median(last_arrival[1:] or last_arrival),
            "section_bytes": section, "section_bytes_per_epoch": section / len(epochs_),
            "epoch_seconds_median": epoch_seconds, "wall_seconds": round(wall, 1)}


def line(xs, ys):
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return slope, my - slope * mx


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="2,3,4")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--at", type=int, default=64, help="the workers' count to extend to. Defaults to 64.")
    args = ap.parse_args()
    rows = [run(int(n), args.epochs, args.samples) for n in args.workers.split(",")]
    xs = [r["workers"] for r in rows]
    g_slope, g0 = line(xs, [r["gather_seconds_median"] for r in rows])
    b_slope, b0 = line(xs, [r["section_bytes_per_epoch"] for r in rows])
    at = args.at
    result = {"command": "python benchmarks/multi_worker.py", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": f"{os.cpu_count()} cores (all workers on one machine, 127.0.0.1)", "rows": rows,
              "extended_to": at, "gather_seconds_at": g0 + g_slope * at,
              "section_bytes_per_epoch_at": b0 + b_slope * at,
              "note": "the gather's fit is over 2-4 workers sharing this machine's cores; on a cluster each worker "
                      "has its own machine and the ring's cost per worker is a network round trip"}
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "results", "multi_worker.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'workers':>7} {'gather ms (last to arrive)':>27} {'report section B/epoch':>23} {'epoch s':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {1000 * r['gather_seconds_median']:>27.2f} {r['section_bytes_per_epoch']:>23.0f} "
              f"{r['epoch_seconds_median']:>8.2f}")
    print(f"{at:>7} {1000 * result['gather_seconds_at']:>27.2f} {result['section_bytes_per_epoch_at']:>23.0f} "
          f"{'(line)':>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
