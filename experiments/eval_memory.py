"""How much memory one window of `evaluate` holds: the peak resident size of the process while it scores fp16 and
one method on one 2,048-token window.

A window's next-token distribution is [T, V] float32: 2 GB on Gemma-3-270M's 262,144 words. The peak is what
decides which background runs fit beside each other on a 24 GB machine. The script reads the kernel's
high-water mark (VmHWM) after loading the model and after each step, resetting it between steps
(/proc/self/clear_refs), so each step's own peak is reported; the numbers are compared with the same steps on
other code by running the script with that code first on PYTHONPATH (`--label` names it in the JSON).

    python experiments/eval_memory.py [--model gemma3-270m] [--recipe out/transfer/gemma3-270m/bbc]
        [--label current] [--json experiments/results/eval_memory.json]

The JSON keeps one entry per label (a later run of the same label replaces it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM: the peak resident size, VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"/proc/self/status has no {field}: this script needs Linux")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--recipe", default="out/transfer/gemma3-270m/bbc")
    ap.add_argument("--method", default="nuq3-1%")
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--label", default="current", help="what code ran (e.g. a commit)")
    ap.add_argument("--json", default="experiments/results/eval_memory.json")
    args = ap.parse_args()

    from kvsqueeze.eval import perplexity as P
    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.methods import parse_methods
    from kvsqueeze.methods.budget import recipe_windows
    from kvsqueeze.recipe import Recipe

    torch.set_num_threads(1)
    model, tok = load_model(args.model, "float32", "cpu")
    recipe = Recipe.load(args.recipe)
    ids = evaluation_windows(tok, load_text("bbc"), args.seqlen, 1).ids
    gb = lambda b: round(b / 2**30, 2)  # noqa: E731
    steps = {"model loaded": gb(_status("VmHWM"))}
    t0 = time.perf_counter()
    _reset_peak()
    specs = parse_methods(f"fp16,{args.method}", layer_windows=recipe_windows(recipe))
    rows = P.evaluate(model, ids, specs, recipe, progress=False)
    steps["evaluate, fp16 and the method, one window: peak"] = gb(_status("VmHWM"))
    steps["after it"] = gb(_status("VmRSS"))
    entry = {"label": args.label, "peak_gib": steps, "seconds": round(time.perf_counter() - t0, 1),
             "rows": [{"method": r.method, "ppl": round(r.ppl, 5), "kld_mean": round(r.kld_mean, 7)} for r in rows]}
    out = Path(args.json)
    payload = json.loads(out.read_text()) if out.is_file() else {}
    payload.update({"machine": machine(), "model": args.model, "recipe": args.recipe, "seqlen": args.seqlen,
                    "text": "BBC corpus, evaluation part, the first of its evenly spread windows",
                    "memory": "the process's peak resident size (VmHWM), GiB"})
    payload["runs"] = [r for r in payload.get("runs", []) if r["label"] != args.label] + [entry]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(entry, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
