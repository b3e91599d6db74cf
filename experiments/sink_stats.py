"""Why offline per-channel key ranges need the sink token kept in fp16: a statistic.

Calibration leaves the first token out of every statistic (it is a sink). This
script measures, on evaluation windows, how far the first token's pre-RoPE keys
fall outside the calibrated per-channel ranges, against the other tokens.

    python experiments/sink_stats.py --recipe out/recipe [--seqlen 2048] [--windows 2]
        [--json experiments/results/sink_stats.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kvsqueeze.eval.plots import capture_kv
from kvsqueeze.eval.texts import load_text, token_windows
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.recipe import Recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--json", default="experiments/results/sink_stats.json")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    windows = token_windows(tok, load_text(args.text).evaluation, args.seqlen, args.windows)
    first_out, rest_out, first_excess = [], [], []
    for w in windows:
        keys = capture_kv(model, w.view(1, -1))["k_pre"]
        for layer, k in enumerate(keys):  # [T, C]
            lo, hi = recipe.channel_range(layer, "k_pre", 0.0)
            outside = (k < lo) | (k > hi)
            half = (hi - lo) / 2
            excess = torch.maximum(lo - k[0], k[0] - hi).clamp_min(0) / half  # distance beyond the range, in ranges
            first_out.append(outside[0].float().mean().item())
            rest_out.append(outside[1:].float().mean().item())
            first_excess.append(excess.max().item())
    n = len(first_out)
    out = {
        "model": args.model, "seqlen": args.seqlen, "windows": int(windows.shape[0]),
        "first_token_channels_outside_range": sum(first_out) / n,
        "other_tokens_elements_outside_range": sum(rest_out) / n,
        "first_token_max_excess_in_half_ranges": max(first_excess),
    }
    print(json.dumps(out, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
