"""The workers of a multi-worker run (tf.distribute.MultiWorkerMirroredStrategy).

Each worker's epoch peak is gathered to every worker through the strategy's own
collective (``strategy.gather``), so the chief's report can say which worker came
closest to its budget. A worker that runs out of memory tells the others through
TensorFlow's coordination service (``report_error_to_cluster``, which MWMS starts):
their collectives are aborted at once with its explanation. Without that, the others
wait in the next all-reduce for as long as the failed worker's process lives (measured:
benchmarks/NOTES.md, "Multi-worker runs").
"""
import dataclasses
import re
import time

from tf_memguard._fit_args import round_down

# Our message inside TensorFlow's "Collective ops is aborted by: <message>\nThe error ...".
_TOLD = re.compile(r"aborted by: (?:Collective ops is aborted by: )*(tf_memguard: .*?)(?:\nThe error could be|\Z)",
                   re.S)


TOLD_KEY = "tf_memguard/out_of_memory"
# How long a worker whose step failed without a refusal of its own waits for another's
# message: the failed worker writes it right after its refusal, before its process does
# anything else (measured: within 0.1 s), so this only bounds the wait when none comes.
TOLD_WAIT_S = 10.0


class Cluster:
    """This worker's place in a multi-worker strategy's cluster."""

    def __init__(self, strategy):
        self.strategy = strategy
        resolver = strategy.cluster_resolver
        spec = resolver.cluster_spec()
        # MWMS numbers the collective group chief first, then the workers.
        self.tasks = [(job, i) for job in ("chief", "worker") if job in spec.jobs
                      for i in range(spec.num_tasks(job))]
        self.task = (resolver.task_type, int(resolver.task_id))
        self.index = self.tasks.index(self.task)

    @property
    def name(self):
        return f"{self.task[0]} {self.task[1]}"

    @property
    def names(self):
        return [f"{job} {i}" for job, i in self.tasks]

    def gather(self, values):
        """Every worker's `values` (numbers, the same count on each), in task order: a
        collective, so every worker must call it at the same point of the run."""
        import tensorflow as tf
        row = [float(self.index)] + [float(v) for v in values]
        per_replica = self.strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant([row], tf.float64))
        rows = self.strategy.gather(per_replica, axis=0).numpy()
        by_task = {}
        for r in rows:  # a worker with several local replicas sent its row once per replica
            by_task.setdefault(int(r[0]), [float(v) for v in r[1:]])
        return [by_task.get(i) for i in range(len(self.tasks))]

    def tell_others(self, message):
        """Ends the other workers' collectives with `message` (a RESOURCE_EXHAUSTED error).

        The message also goes into the coordination service's key-value store first: the
        failed step's own collectives abort the others' with TensorFlow's bare error, which
        can reach them before the report does (seen in CI), and they read it there."""
        from tensorflow.python.eager import context
        from tensorflow.python.framework import errors
        try:
            context.context().set_config_key_value(TOLD_KEY, message)
        except Exception:  # noqa: BLE001 - the report below still ends the others
            pass
        try:
            context.context().report_error_to_cluster(errors.RESOURCE_EXHAUSTED, message)
        except Exception:  # noqa: BLE001 - no coordination service: the others see the socket close
            return False
        return True

    def told_elsewhere(self, timeout_s=TOLD_WAIT_S):
        """Another worker's message from the key-value store (see tell_others), waiting up
        to `timeout_s` for it to be written, or None."""
        from tensorflow.python.eager import context
        try:
            value = context.context().get_config_key_value(TOLD_KEY, timeout_in_ms=int(1000 * timeout_s))
        except Exception:  # noqa: BLE001 - none was written in time, or no service
            return None
        return value or None


def cluster_of(model):
    """The Cluster of `model`'s strategy when it is a multi-worker one, else None."""
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return None
    import tensorflow as tf
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict() or resolver.task_type is None:
        return None
    cluster = Cluster(strategy)
    return cluster if len(cluster.tasks) > 1 else None


def told(error):
    """The message another worker told this one with (see Cluster.tell_others), or None."""
    m = _TOLD.search(str(getattr(error, "message", "") or error))
    return m.group(1).strip() if m else None


class ClusterRecord:
    """A MemGuardCallback run's view of the cluster: every worker's epochs, gathered at each
    epoch's end (one all-gather of 4 numbers a worker), and the others told of a failure."""

    def __init__(self, cluster):
        self.cluster = cluster
        # {"epoch", "gather_seconds" (this worker's wait in the all-gather, the others'
        # lateness included), "peak_bytes", "budget_bytes", "live_bytes",
        # "suggested_batch_size": one entry per worker each}
        self.epochs = []
        self.told = False

    def epoch_end(self, epoch, record, budget, suggestion, logs):
        """Gathers this epoch's peaks and suggestions (a worker whose callback is not active
        sends zeros: every worker must take part), writes the highest peak into `logs`, and
        returns the suggestion that fits every worker: the smallest of theirs (a batch size
        is the global one, the same on every worker)."""
        peak, live = (record.peak_bytes, record.live_bytes) if record is not None else (0, 0)
        size, predicted = (suggestion.batch_size, suggestion.predicted_peak_bytes) if suggestion else (-1, 0)
        t = time.perf_counter()
        rows = self.cluster.gather([peak, budget or 0, live, size, predicted])
        seconds = time.perf_counter() - t
        rows = [r or [0.0, 0.0, 0.0, -1.0, 0.0] for r in rows]
        entry = {"epoch": epoch + 1, "gather_seconds": round(seconds, 6), "peak_bytes": [int(r[0]) for r in rows],
                 "budget_bytes": [int(r[1]) for r in rows], "live_bytes": [int(r[2]) for r in rows],
                 "suggested_batch_size": [int(r[3]) if r[3] >= 0 else None for r in rows]}
        self.epochs.append(entry)
        logs["memguard_cluster_peak_mib"] = round(max(entry["peak_bytes"]) / float(1 << 20), 2)
        sizes = [(int(r[3]), i) for i, r in enumerate(rows) if r[3] >= 0]
        if suggestion is None or not sizes:
            return suggestion
        smallest, i = min(sizes)
        # A size that divides gives every replica the same share of the global batch; one
        # that does not gives the workers batches of different shapes, which Keras 3.15's
        # fit() cannot all-reduce when it builds the model (a shape mismatch in the
        # collective, measured, unless the model's build is given each worker's own batch
        # as examples/multi_worker.py does).
        replicas = self.cluster.strategy.num_replicas_in_sync
        fitting = round_down(smallest, replicas)
        if fitting == suggestion.batch_size:
            return suggestion
        method = suggestion.method
        if smallest < suggestion.batch_size:
            method += f"; the smallest of the workers' ({self.cluster.names[i]}'s)"
        if fitting != smallest:
            method += f", rounded down to a multiple of the {replicas} replicas"
        return dataclasses.replace(suggestion, batch_size=fitting, method=method,
                                   predicted_peak_bytes=int(rows[i][4]) if smallest < suggestion.batch_size
                                   else suggestion.predicted_peak_bytes)

    def tell_others(self, explanation):
        """Once per run: the other workers' collectives end with this worker's explanation."""
        if self.told:
            return
        self.told = self.cluster.tell_others(f"tf_memguard: {self.cluster.name} ran out of memory: {explanation}")

    def to_dict(self):
        return {"worker": self.cluster.name, "workers": self.cluster.names, "epochs": list(self.epochs)}


def report_lines(cluster):
    """The report's per-worker section, from ClusterRecord.to_dict()."""
    from tf_memguard._report import per_unit_lines
    names, epochs = cluster["workers"], cluster["epochs"]
    lines = per_unit_lines(f"per worker ({len(names)} workers, gathered each epoch; this report is "
                           f"{cluster['worker']}'s):", names, epochs)
    sizes = [(s, i) for i, s in enumerate(epochs[-1].get("suggested_batch_size", [])) if s is not None] \
        if epochs else []
    if sizes:
        smallest, i = min(sizes)
        lines.append(f"batch sizes the workers' own steps fit: {', '.join(str(s) for s, _ in sorted(sizes, key=lambda t: t[1]))}"
                     f" (the smallest, {names[i]}'s, rounded down to a multiple of the replicas, is the suggestion)")
    return lines
