"""Train with tf.distribute.MultiWorkerMirroredStrategy on local CPU workers, each under its
own budget, and print the chief's memory report with every worker's peaks.

    python examples/multi_worker.py [--workers 2] [--budgets 256MiB,256MiB] [--batch-size 64]

Starts --workers processes on 127.0.0.1 (TF_CONFIG set for each), waits for them (at most
--timeout seconds), and prints each worker's last lines. Each worker writes its report to
--out/worker-<i>.json. A worker whose budget is too small for its step runs out of memory,
explains it, and tells the others, which stop at once with its explanation (they would
otherwise wait in the next all-reduce for as long as it lives).

On a real cluster, run the worker part on each machine with its own TF_CONFIG:

    python examples/multi_worker.py --task 1 --ports 2222,2222 --hosts host-a,host-b --budget 6GiB
"""
import argparse
import faulthandler
import json
import os
import socket
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def fix_keras_multi_worker(strategy):
    """Keras 3.15's fit() under MultiWorkerMirroredStrategy with more than one worker fails
    before its first step, for two reasons in how it calls strategy.reduce (Keras 3.15.1
    with TensorFlow 2.21, benchmarks/NOTES.md "Multi-worker runs"): it reduces a batch of
    (x, y) in one call, which MWMS's reduce does not map over as MirroredStrategy's does
    ("Attempt to convert a value (PerReplica...)"), and it reduces the scalar metrics with
    axis=0 ("Invalid reduction dimension 0 for input with 0 dimensions"). This maps the
    call over nests, drops the axis of a scalar and gives the model's build this worker's
    batch; nothing of tf_memguard needs it."""
    import tensorflow as tf
    reduce = strategy.reduce

    def rank(value):
        return strategy.experimental_local_results(value)[0].shape.rank

    def one(reduce_op, v, axis):
        if axis is None and rank(v):
            # The batch fit() reduces to build the model is read for its shapes only: this
            # worker's own (an all-reduce needs the same shape on every worker, and a
            # global batch that does not divide over them gives different ones).
            return strategy.experimental_local_results(v)[0]
        return reduce(reduce_op, v, axis if axis is None or rank(v) else None)

    def mapped(reduce_op, value, axis=None):
        return tf.nest.map_structure(lambda v: one(reduce_op, v, axis), value)
    strategy.reduce = mapped
    return strategy


def worker(args):
    # A worker still running 10 s before the launcher gives up prints every thread's
    # stack, so that a hang shows where it is (the launcher prints the workers' output).
    faulthandler.dump_traceback_later(max(args.timeout - 10, 1), exit=False)
    hosts = args.hosts.split(",") if args.hosts else ["127.0.0.1"] * len(args.ports.split(","))
    cluster = [f"{h}:{p}" for h, p in zip(hosts, args.ports.split(","))]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": cluster},
                                          "task": {"type": "worker", "index": args.task}})
    import tf_memguard
    tf_memguard.install(max_bytes=args.budget)   # before TensorFlow builds anything
    import keras
    import tensorflow as tf
    from _data import pattern_images, small_cnn

    strategy = fix_keras_multi_worker(tf.distribute.MultiWorkerMirroredStrategy())
    held = tf.zeros([args.hold_mib << 18], tf.float32) if args.hold_mib else None  # noqa: F841 - kept alive
    x, y = pattern_images(args.samples)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = small_cnn()
        model.compile(keras.optimizers.Adam(1e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    callback = tf_memguard.MemGuardCallback()
    status = 0
    try:
        history = model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=2,
                            callbacks=[callback])
        print(f"history {json.dumps({k: [float(v) for v in vs] for k, vs in history.history.items()})}")
    except (tf.errors.ResourceExhaustedError, tf_memguard.BudgetExceededError) as e:
        at, notes = time.time(), getattr(e, "__notes__", [])
        print(f"{type(e).__name__} at {at:.2f}: " + " ".join(notes), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"worker-{args.task}-error.json"), "w") as f:
                json.dump({"error": type(e).__name__, "at": at, "notes": notes}, f)
        status = 3
        if args.linger:  # a process that goes on with other work after the error
            time.sleep(args.linger)
    report = callback.report
    if args.out and report is not None:
        os.makedirs(args.out, exist_ok=True)
        report.to_json(os.path.join(args.out, f"worker-{args.task}.json"))
    return status


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(args):
    budgets = args.budgets.split(",") if args.budgets else [args.budget] * args.workers
    if len(budgets) != args.workers:
        raise SystemExit(f"--budgets names {len(budgets)} budgets for {args.workers} workers")
    holds = [int(h) for h in args.holds.split(",")] if args.holds else [0] * args.workers
    ports = ",".join(str(p) for p in free_ports(args.workers))
    procs = []
    for i in range(args.workers):
        cmd = [sys.executable, os.path.abspath(__file__), "--task", str(i), "--ports", ports, "--budget", budgets[i],
               "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--samples", str(args.samples),
               "--hold-mib", str(holds[i]), "--out", args.out, "--linger", str(args.linger),
               "--timeout", str(args.timeout)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.time()
    ends = [None] * len(procs)

    def wait(i, p):
        try:
            out, _ = p.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += f"\n(worker {i} killed after {args.timeout:.0f} s)"
        ends[i] = (p.returncode, round(time.time() - start, 2), out)
    threads = [threading.Thread(target=wait, args=(i, p)) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = []
    for i, (code, seconds, out) in enumerate(ends):
        print(f"== worker {i} (budget {budgets[i]}): exit {code} after {seconds:.1f} s")
        print("\n".join(line for line in out.splitlines() if not line.startswith(("W0000", "I0000", "E0000")))[-4000:])
        summary.append({"worker": i, "budget": budgets[i], "exit": code, "seconds": seconds})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "workers.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if all(e["exit"] == 0 for e in summary) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="local workers to start. Defaults to 2.")
    ap.add_argument("--budgets", default="", help="one budget per worker, comma-separated. Defaults to --budget each.")
    ap.add_argument("--budget", default="256MiB", help="a worker's budget. Defaults to 256MiB.")
    ap.add_argument("--batch-size", type=int, default=64, help="the global batch size. Defaults to 64.")
    ap.add_argument("--epochs", type=int, default=2, help="Defaults to 2.")
    ap.add_argument("--samples", type=int, default=2048, help="Defaults to 2048.")
    ap.add_argument("--holds", default="", help="MiB each worker keeps in an extra tensor beside the model "
                    "(comma-separated; to see workers differ in the report). Defaults to none.")
    ap.add_argument("--out", default="memguard_out", help="where the reports go. Defaults to memguard_out.")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the workers. Defaults to 300.")
    ap.add_argument("--task", type=int, default=None, help="run as this worker (started by the launcher).")
    ap.add_argument("--ports", default="", help="the workers' ports (worker mode).")
    ap.add_argument("--hosts", default="", help="the workers' hosts (worker mode). Defaults to 127.0.0.1 each.")
    ap.add_argument("--hold-mib", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--linger", type=float, default=0, help="seconds a worker stays alive after an out-of-memory "
                    "error (to see that the others do not wait for it). Defaults to 0.")
    args = ap.parse_args(argv)
    if args.task is not None:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
