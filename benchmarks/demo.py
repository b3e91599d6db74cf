"""`make demo` from a fresh clone, timed as a new user meets it.

    python benchmarks/demo.py [--repo .] [--json benchmarks/results/demo_amd_epyc.json]

Clones the repository's committed HEAD into a temporary directory and runs `make demo` there with a cache of
its own (`KVSQUEEZE_CACHE` inside the clone, so the model is converted afresh; pip's download cache is the
machine's), then records the wall time, the calibration's own timings (`out/recipe/recipe.json`), the
perplexities it printed (`out/eval.json`) and the machine.
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
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "demo.json"))
    args = p.parse_args(argv)
    commit = subprocess.run(["git", "-C", args.repo, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "kvsqueeze"
        subprocess.run(["git", "clone", "-q", args.repo, str(clone)], check=True)
        env = {**os.environ, "KVSQUEEZE_CACHE": str(clone / ".cache")}
        env.pop("VIRTUAL_ENV", None)
        load = os.getloadavg()
        t0 = time.perf_counter()
        run = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if run.returncode != 0:
            raise SystemExit(f"make demo failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        recipe = json.loads((clone / "out" / "recipe" / "recipe.json").read_text())
        evaluated = json.loads((clone / "out" / "eval.json").read_text())
    payload = {"command": "make demo in a fresh clone (install, convert the model, calibrate with the defaults, "
                          "kvsqueeze eval with the defaults)",
               "commit": commit, "machine": machine(), "wall_s": round(wall, 1),
               "calibration_timings_s": recipe["timings_s"], "calibration_settings": recipe["settings"],
               "load_average_start": load, "load_average_end": os.getloadavg(),
               "model": evaluated.get("model"), "text": evaluated.get("text"), "seqlen": evaluated.get("seqlen"),
               "windows": evaluated.get("windows"),
               "rows": [{k: r.get(k) for k in ("method", "avg_bits", "ppl", "ci95")} for r in evaluated["rows"]]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"make demo: {wall / 60:.1f} min; wrote {args.json}")


if __name__ == "__main__":
    main()
