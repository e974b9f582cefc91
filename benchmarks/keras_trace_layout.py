"""Physical memory a real Keras step pattern needs under different placements, offline.

The trace is the pool's own record (allocations and frees, in order, with sizes) of the
Keras CNN of benchmarks/gpu/keras_torch.py on PyTorch on the H200 (3 epochs, batch 256):
benchmarks/data/keras_torch_cnn_trace.npz. Replayed here through the pool on host
memory (256-byte granule, as on CUDA), the pool's trace gives each block's offset, from
which the 2 MiB granules a CUDA pool would back are counted. The default layout must
reproduce what the H200 measured (peak backed / peak live 1.0962), which checks the
method; the other rows are layouts and policies tried to get nearer 1.0. The last rows
replay the trace through the real pool backed on demand in 2 MiB granules (host memory
standing in for CUDA virtual memory), with trim_above_peak: its own counters.

  python benchmarks/keras_trace_layout.py     (prints a table; writes
                                               benchmarks/results/keras_trace_layout.json)
"""
import collections
import json
import math
import os

import numpy as np

import tf_memguard

HERE = os.path.dirname(os.path.abspath(__file__))
GRANULE = 2 << 20


def load(path=os.path.join(HERE, "data", "keras_torch_cnn_trace.npz")):
    d = np.load(path)
    return d["op"].tolist(), d["size"].tolist(), d["address"].tolist()


def placed(ops, zone_of=lambda size: 0, **pool_args):
    """Replays the trace through one pool per zone; returns [(zone, events)]."""
    op, size, addr = ops
    pools, live = {}, {}
    for o, s, a in zip(op, size, addr):
        if o == 0:
            z = zone_of(s)
            if z not in pools:
                pools[z] = tf_memguard.Pool(max_bytes=8 << 30, alignment=256, trace_capacity=len(op) + 16,
                                            **pool_args)
            live[a] = (z, pools[z].allocate(s))
        elif o == 1:
            z, x = live.pop(a)
            pools[z].free(x)
    return [(z, p.trace()["events"]) for z, p in pools.items()]


def granules(e):
    return range(e["offset"] // GRANULE, (e["offset"] + e["size"] - 1) // GRANULE + 1)


def peak_live(events):
    cur = peak = 0
    for e in events:
        cur += e["size"] if e["op"] == "alloc" else -e["size"]
        peak = max(peak, cur)
    return peak


def backed(zones, start=0):
    """Bytes of granules ever touched (never unmapped), from event `start` on (blocks
    live at `start` included)."""
    total = 0
    for _, events in zones:
        touched, blocks = set(), {}
        for i, e in enumerate(events):
            if i < start:
                if e["op"] == "alloc":
                    blocks[e["offset"]] = e
                else:
                    blocks.pop(e["offset"], None)
                continue
            if i == start:
                for b in blocks.values():
                    touched.update(granules(b))
            if e["op"] == "alloc":
                touched.update(granules(e))
        total += len(touched) * GRANULE
    return total


def stealing(events):
    """Backing that takes physical granules from free holes before mapping new ones:
    (peak backed, number of steals). Each steal needs a device synchronization (kernels
    still queued may use freed blocks) and remapping."""
    refs, mapped, steals, peak = collections.Counter(), set(), 0, 0
    for e in events:
        gs = granules(e)
        if e["op"] == "alloc":
            for g in gs:
                refs[g] += 1
            need = [g for g in gs if g not in mapped]
            if need:
                spare = [g for g in mapped if refs[g] == 0][:len(need)]
                if spare:
                    steals += 1
                    mapped.difference_update(spare)
            mapped.update(gs)
            peak = max(peak, len(mapped) * GRANULE)
        else:
            for g in gs:
                refs[g] -= 1
    return peak, steals


def on_demand(ops, trim, move=False, zone_threshold=0):
    """The trace through the real pool backed on demand in 2 MiB granules, as a CUDA pool
    (host_on_demand, TF_MEMGUARD_HOST_GRANULE): its own stats, peak_bytes_reserved being
    the peak of bytes backed. move: reclaims move granules as the CUDA upstream does
    (TF_MEMGUARD_HOST_RETIRE=1); the stats then carry the pool's backing summary.
    zone_threshold: 0, one zone (the default); 65536: requests below 64 KiB in a zone of
    their own."""
    env = {"TF_MEMGUARD_HOST_GRANULE": str(GRANULE)}
    if move:
        env["TF_MEMGUARD_HOST_RETIRE"] = "1"
    os.environ.update(env)
    try:
        pool = tf_memguard.Pool(max_bytes=8 << 30, alignment=256, upstream="host_on_demand", trim_above_peak=trim,
                                zone_threshold=zone_threshold)
    finally:
        for k in env:
            del os.environ[k]
    op, size, addr = ops
    live = {}
    for o, n, a in zip(op, size, addr):
        if o == 0:
            live[a] = pool.allocate(n)
        elif o == 1:
            pool.free(live.pop(a))
    stats = pool.stats()
    stats["describe"] = pool.describe()
    pool.close(force=True)
    return stats


def main():
    ops = load()
    default = placed(ops)
    live = peak_live(default[0][1])
    rows = []

    def row(name, b, note=""):
        rows.append({"layout": name, "peak_backed_bytes": b, "over_peak_live": b / live, "note": note})

    row("one region, best fit, small (< 1 MiB) at the top (default)", backed(default))
    row("same, from the 5,000th event (steady state)", backed(default, start=5000),
        "later steps alone: the first steps add the rest")
    for small in (64 << 10, 8 << 20, 1 << 40):
        row(f"small_threshold {tf_memguard.format_bytes(small)}", backed(placed(ops, small_threshold=small)))
    zones = {
        "zones: < 1 MiB, >= 1 MiB": lambda s: s >= 1 << 20,
        "zones: < 1 MiB, 1-64 MiB, >= 64 MiB": lambda s: 0 if s < 1 << 20 else 1 if s < 64 << 20 else 2,
        "zones: one per power of two >= 1 MiB": lambda s: 0 if s < 1 << 20 else int(math.log2(s)),
        "zones: one per size >= 1 MiB": lambda s: 0 if s < 1 << 20 else s,
    }
    for name, f in zones.items():
        row(name, backed(placed(ops, zone_of=f)))
    peak, steals = stealing(default[0][1])
    row("take granules from free holes before mapping new ones", peak,
        f"{steals} steals (device syncs + remaps) in {len(default[0][1])} events")
    for trim in (0.0, 0.06, 0.04, 0.03, 0.02):
        s = on_demand(ops, trim)
        row(f"the pool backed on demand (2 MiB granules, as CUDA), trim_above_peak {trim}",
            s["peak_bytes_reserved"], f"{s['num_reclaims']} reclaims, {s['bytes_reclaimed'] >> 20} MiB unmapped")
    for trim in (0.0, 0.04):
        s = on_demand(ops, trim, move=trim > 0, zone_threshold=64 << 10)
        row(f"requests below 64 KiB in a zone of their own, trim {trim}" + (", reclaims moving granules" if trim else ""),
            s["peak_bytes_reserved"], f"{s['num_reclaims']} reclaims; " + s["describe"].rsplit("; ", 1)[-1])
    for trim in (0.06, 0.04, 0.03, 0.02):
        s = on_demand(ops, trim, move=True)
        row(f"the same, trim {trim}, reclaims moving granules (as the CUDA upstream)", s["peak_bytes_reserved"],
            f"{s['num_reclaims']} reclaims; " + s["describe"].rsplit("; ", 2)[-2:][0] + "; "
            + s["describe"].rsplit("; ", 1)[-1])

    print(f"peak live {tf_memguard.format_bytes(live)} ({live} bytes); granule {GRANULE >> 20} MiB")
    print(f"| layout | peak backed | / peak live | note |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {tf_memguard.format_bytes(r['peak_backed_bytes'])} | "
              f"{r['over_peak_live']:.4f} | {r['note']} |")
    out = os.path.join(HERE, "results", "keras_trace_layout.json")
    with open(out, "w") as f:
        json.dump({"command": "python benchmarks/keras_trace_layout.py", "peak_live_bytes": live,
                   "granule_bytes": GRANULE, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
