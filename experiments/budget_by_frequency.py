"""Where a per-channel bit budget puts its key bits along the RoPE frequencies.

Keys are quantized before RoPE, one width per channel (`:chan` budgets). With the
rotate-half layout the Hugging Face models use, channels i and i + D/2 of a head
turn together at frequency index i (0 the fastest, D/2 - 1 the slowest). This
script resolves a budget method (a preset for the context given) from a recipe alone, as the cache does (no
model is loaded), and reports the
mean key width and the share of 1-2-bit channels at each frequency index, over
layers, heads and both halves: whether the budget, chosen from the Fisher
information of 2K-token calibration windows, starves the fast channels that fine
relative positions (and so copying from far away) rely on. It reads the layout of
full rotate-half RoPE (every head turned, as in Qwen2.5, Llama / SmolLM2 and Gemma-3).

    python experiments/budget_by_frequency.py --recipe out/models/qwen2.5-coder-0.5b/recipe
        [--method q3.5] [--tokens 4096] [--json experiments/results/budget_by_frequency.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from kvsqueeze.methods import preset_for
from kvsqueeze.methods.budget import recipe_windows
from kvsqueeze.methods.budget import spec_allocation
from kvsqueeze.recipe import Recipe


def by_frequency(widths: np.ndarray, head_dim: int) -> dict:
    """widths [layers, channels] of pre-RoPE keys -> per frequency index: mean width, share of widths <= 2."""
    layers, channels = widths.shape
    if channels % head_dim or head_dim % 2:
        raise SystemExit(f"{channels} key channels do not split into heads of {head_dim} (an even number)")
    w = widths.reshape(layers, channels // head_dim, 2, head_dim // 2)  # [L, H, half, frequency]
    return {"mean_width": [round(float(x), 3) for x in w.mean(axis=(0, 1, 2))],
            "share_1_2_bits": [round(float(x), 3) for x in (w <= 2).mean(axis=(0, 1, 2))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--method", default="q3.5", help="a ':chan' budget, or a preset")
    ap.add_argument("--tokens", type=int, default=4096, help="the context a preset is chosen for")
    ap.add_argument("--json", default="experiments/results/budget_by_frequency.json")
    args = ap.parse_args()

    recipe = Recipe.load(args.recipe)
    fp = recipe.meta["model"]["fingerprint"]
    head_dim = int(fp["head_dim"])
    channels = int(fp["kv_heads"]) * head_dim
    spec = preset_for(args.method, args.tokens, recipe_windows(recipe))
    alloc = spec_allocation(spec, recipe)
    widths = np.array([k.widths if k.widths is not None else [k.bits] * channels for k in alloc.keys])
    table = by_frequency(widths, head_dim)
    result = {"recipe": args.recipe, "model": recipe.meta["model"].get("id"), "method": args.method,
              "resolved": spec.name, "tokens": args.tokens, "budget_bits": round(alloc.bits, 4),
              "value_bits_by_layer": [int(v.bits) for v in alloc.values],
              "frequency_index": "0 = the fastest-turning pair of channels (i, i + head_dim/2); the layout of "
                                 "full rotate-half RoPE (Qwen2.5, Llama / SmolLM2, Gemma-3)", **table}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print("index  mean width  share at 1-2 bits")
    for i, (m, s) in enumerate(zip(table["mean_width"], table["share_1_2_bits"])):
        print(f"{i:5d}  {m:10.2f}  {s:17.2f}")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
