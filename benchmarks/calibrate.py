"""How long `kvsqueeze calibrate` takes with its defaults, as a user runs it.

    python benchmarks/calibrate.py [--model smollm2-135m] [--runs 1] [--json benchmarks/results/calibrate.json]

Each run is the command itself in a fresh process (imports, model load, the Fisher pass, the fit, the recipe
written) into a new directory; the JSON records each run's wall time, the phases the recipe records
(`timings_s`), the settings and the machine with its load average, so that a run beside another job shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="bbc")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "calibrate.json"))
    args = p.parse_args(argv)
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {args.runs}")
    exe = Path(sys.executable).with_name("kvsqueeze")
    rows = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            load = os.getloadavg()
            t0 = time.perf_counter()
            run = subprocess.run([str(exe), "calibrate", "--model", args.model, "--text", args.text, "--out", tmp],
                                 stdout=subprocess.DEVNULL)
            if run.returncode:  # its own error is above, on stderr
                raise SystemExit(f"kvsqueeze calibrate failed (exit {run.returncode}): nothing timed")
            wall = time.perf_counter() - t0
            meta = json.loads((Path(tmp) / "recipe.json").read_text())
        rows.append({"run": i, "wall_s": round(wall, 1), "timings_s": meta["timings_s"],
                     "load_average_start": load, "load_average_end": os.getloadavg()})
        print(rows[-1])
    payload = {"command": f"kvsqueeze calibrate --model {args.model} --text {args.text} --out DIR (defaults)",
               "model": args.model, "text": args.text, "settings": meta["settings"], "machine": machine(),
               "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
