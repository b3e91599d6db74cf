"""The KVQuant ablation ladder and bit-width table on one model and text (simulated quantization).

    python benchmarks/ladder.py --recipe out/recipe [--model smollm2-135m] [--text bbc]
        [--seqlen 2048] [--windows 4] [--json benchmarks/results/ladder.json]

Writes {"model", "text", "seqlen", "windows", "rows": [{"method", "avg_bits", "ppl", "step"}]}
and prints a Markdown table (PPL change against fp16) for the README.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import evaluate
from kvsqueeze.eval.texts import load_text, token_windows
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import Recipe

LADDER = [
    ("int3", "int3: keys per-token post-RoPE (baseline)"),
    ("int3:kchan", "+ keys per-channel (post-RoPE)"),
    ("int3:kchan:pre", "+ keys pre-RoPE"),
    ("nuq3:sink0:unw", "nuq3, unweighted k-means"),
    ("nuq3:sink0:fisher", "nuq3, Fisher-weighted"),
    ("nuq3:sink0", "nuq3, Fisher * s^2 (KVQuant)"),
    ("nuq3-0.1%:pm:sink0", "+ 0.1% outliers, per-matrix"),
    ("nuq3-1%:pm:sink0", "+ 1% outliers, per-matrix"),
    ("nuq3-0.1%:sink0", "+ 0.1% outliers, per-vector"),
    ("nuq3-1%:sink0", "+ 1% outliers, per-vector"),
    ("nuq3-1%", "+ 1 fp16 attention sink"),
]
BITS = [
    (f"{fam}{b}{suffix}", f"{b}-bit")  # described from the name by benchmarks/report.py
    for b in (4, 3, 2)
    for fam, suffix in (("int", ""), ("nf", ""), ("int", ":kchan:pre"), ("nf", ":kchan:pre"), ("nuq", ""), ("nuq", "-1%"))
]
OTHERS = [
    ("kivi2", "KIVI-2 (group 32, 128 fp16 recent)"),
    ("kivi4", "KIVI-4"),
    ("group3", "grouped uniform per-token, group 128 (ATOM/FlexGen)"),
    ("group3:g64", "grouped uniform per-token, group 64"),
    ("nuq-k3v2-1%", "mixed: keys 3-bit, values 2-bit, 1% outliers"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--json", default="benchmarks/results/ladder.json")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    windows = token_windows(tok, load_text(args.text).evaluation, args.seqlen, args.windows)
    steps: dict[str, str] = {"fp16": "fp16 baseline"}
    for name, label in LADDER + BITS + OTHERS:
        steps.setdefault(parse_method(name).name, label)
    specs = [parse_method(n) for n in steps]
    t0 = time.perf_counter()
    rows = evaluate(model, windows, specs, recipe)
    base = rows[0].ppl
    payload = {
        "model": args.model, "text": f"{args.text} (evaluation part)", "seqlen": args.seqlen,
        "windows": int(windows.shape[0]),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "recipe": recipe.meta.get("settings"),
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": [{"method": r.method, "avg_bits": round(r.avg_bits, 4), "ppl": round(r.ppl, 4),
                  "step": steps[r.method]} for r in rows],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print("| method | what | avg bits | PPL | vs fp16 |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r.method}` | {steps[r.method]} | {r.avg_bits:.2f} | {r.ppl:.3f} | {(r.ppl / base - 1) * 100:+.2f}% |")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
