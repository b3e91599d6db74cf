"""`benchmarks/decode.py --step` at 32K for `nuq3-1%`, with the parts of each fused step timed call by call.

The step of `nuq3-1%` at 32K swings between runs of the benchmark (docs/notes.md). This runs the benchmark's own
rounds (`--contexts 32768 --methods nuq3-1% --step --no-reference --rounds 15`) with wall-clock timers around the
parts of the fused step: the store's `append` and `view`, the kernel's inputs (`kernel_inputs`) and its compiled
entry (`_attend`), and keeps each part's times of the 15 timed rounds in order. Environment variables of the
run (OMP_WAIT_POLICY, GOMP_SPINCOUNT, ...) apply as given. Appends one row per run to the JSON.

    python experiments/decode_step_swing.py [--runs 4] [--json experiments/results/decode_step_swing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import atexit, json, runpy, sys, time
import kvsqueeze.kernels.numba.attend as A
from kvsqueeze.cache.store import KVStore
T = {}
def wrap(name, f):
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); T.setdefault(name, []).append(time.perf_counter() - t0); return r
    return g
A._attend = wrap("_attend", A._attend)
A.kernel_inputs = wrap("kernel_inputs", A.kernel_inputs)
KVStore.append = wrap("append", KVStore.append)
KVStore.view = wrap("view", KVStore.view)
out = sys.argv[1]
def report():
    steps = json.load(open(out + ".bench"))["steps"]
    json.dump({"step_median_ms": next(r["median_ms"] for r in steps if r["method"] == "nuq3-1%"),
               "static_float32_median_ms": next(r["median_ms"] for r in steps if r["method"] == "static-float32"),
               "rounds_ms": {k: [round(1e3 * x, 3) for x in v[-15:]] for k, v in T.items()}}, open(out, "w"))
atexit.register(report)
sys.argv = ["decode.py", "--contexts", "32768", "--methods", "nuq3-1%", "--step", "--no-reference", "--rounds",
            "15", "--json", out + ".bench"]
runpy.run_path("benchmarks/decode.py", run_name="__main__")
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "decode_step_swing.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import decode_machine

    path = Path(args.json)
    whole = json.loads(path.read_text()) if path.is_file() else {"machine": decode_machine(), "runs": []}
    env_keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")
    for _ in range(args.runs):
        out = Path("/tmp") / f"swing.{os.getpid()}.json"
        subprocess.run([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, check=True, capture_output=True)
        row = {"env": {k: os.environ.get(k) for k in env_keys}, **json.loads(out.read_text())}
        whole["runs"].append(row)
        print(json.dumps({"env": row["env"], "step_median_ms": row["step_median_ms"],
                          "_attend": row["rounds_ms"]["_attend"]}), flush=True)
    path.write_text(json.dumps(whole, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
