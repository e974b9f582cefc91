"""Writes the traces of benchmarks/alloc_latency.py as binary files for gpu_proof.cu:
NAME.bin (tfmg_replay_op records: u64 size, u32 slot, u32 is_free) and NAME.meta
("ops slots peak_live_bytes").

With --seeds 1,2,...: also the three churn kinds made with those seeds (100,000
operations each, as alloc_latency.py --seeds makes them), named KIND_sSEED, listed in
seeds.txt (gpu_proof TRACE_DIR OUT.json seeds)."""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import traces  # noqa: E402


def write(out, t, name=None):
    name = name or t.name
    ops = np.zeros(t.ops, dtype=[("size", "<u8"), ("slot", "<u4"), ("is_free", "<u4")])
    ops["size"], ops["slot"], ops["is_free"] = t.sizes, t.slots, t.is_free
    ops.tofile(os.path.join(out, name + ".bin"))
    with open(os.path.join(out, name + ".meta"), "w") as f:
        f.write(f"{t.ops} {t.nslots} {t.peak_live_bytes}\n")
    print(name, t.ops, t.peak_live_bytes)
    return name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out")
    ap.add_argument("--seeds", default="", help="comma-separated seeds of more churn traces")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    for t in traces.standard_traces():
        write(args.out, t)
    if args.seeds:
        names = []
        for kind, live, hi in traces.CHURN_KINDS:
            for seed in (int(s) for s in args.seeds.split(",")):
                t = traces.churn(kind, live, 256, hi, ops=100_000, seed=seed)
                names.append(write(args.out, t, f"{kind}_s{seed}"))
        with open(os.path.join(args.out, "seeds.txt"), "w") as f:
            f.write("\n".join(names) + "\n")


if __name__ == "__main__":
    main()
