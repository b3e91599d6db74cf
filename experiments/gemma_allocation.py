"""Where the 3.5-bit preset puts its bits on Gemma-3-270M, layer by layer, at 2,048 and at 32,768 tokens.

Gemma-3-270M's 15 sliding-window layers hold 511 tokens and its 3 full layers every token, so at 2,048 tokens a
full layer holds four times what a sliding one does and its fixed costs (fp16 window, sinks, tables) weigh a
quarter as much per element. For each recipe found under `--recipes/gemma3-270m/` (`benchmarks/transfer.py`'s:
bbc, code, mix) and each context, the preset's budget is chosen as the cache chooses it (no weights loaded), and
per layer this writes: the tokens held, the mean and largest key and value code widths, the outlier fraction,
and the bits per element the layer's codes, scales, outliers and tables hold (`budget.unit_bits`), with the bits
the layers share (fp16 window, sinks, positions) averaged over every element held.

    python experiments/gemma_allocation.py [--recipes out/transfer] [--json experiments/results/gemma_allocation.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", default="out/transfer")
    ap.add_argument("--preset", default="q3.5")
    ap.add_argument("--contexts", default="2048,32768")
    ap.add_argument("--json", default="experiments/results/gemma_allocation.json")
    args = ap.parse_args()

    from kvsqueeze.methods import budget as B
    from kvsqueeze.methods.spec import preset_for
    from kvsqueeze.recipe import Recipe

    rows = []
    for calib in ("bbc", "code", "mix"):
        path = Path(args.recipes) / "gemma3-270m" / calib
        if not (path / "recipe.json").exists():
            continue
        recipe = Recipe.load(path)
        fp = recipe.meta["model"]["fingerprint"]
        channels = fp["kv_heads"] * fp["head_dim"]
        for tokens in (int(t) for t in args.contexts.split(",")):
            spec = preset_for(args.preset, tokens, ())  # the 32-token window these measurements took apart
            alloc = B.allocate_channels(recipe, spec.budget, spec.sinks, tokens=tokens, window=spec.window)
            hold = B._Holding.of(recipe, tokens, spec.sinks)
            layers = []
            for i, (k, v) in enumerate(zip(alloc.keys, alloc.values)):
                n = hold.held[i]
                row = {"layer": i, "held": n}
                for kv, c in (("k", k), ("v", v)):
                    widths = c.widths or (c.bits,) * channels
                    row[f"{kv}_mean_width"] = round(sum(widths) / len(widths), 3)
                    row[f"{kv}_max_width"] = max(widths)
                    row[f"{kv}_outliers"] = c.fraction
                    row[f"{kv}_bits"] = round(B.unit_bits(kv, c, n, channels, hold.kept[i]) / (n * channels), 3)
                layers.append(row)
            full = [r for r in layers if r["held"] == max(hold.held)]
            sliding = [r for r in layers if r["held"] != max(hold.held)]
            mean = lambda rs, key: round(sum(r[key] for r in rs) / len(rs), 3) if rs else None  # noqa: E731
            rows.append({"calib_text": calib, "preset": args.preset, "resolved": spec.name, "tokens": tokens,
                         "bits": round(alloc.bits, 4),
                         "shared_bits": round(hold.shared(channels, spec.sinks, spec.window) / hold.elements(channels),
                                              4),
                         "full_layers_mean_width": {"k": mean(full, "k_mean_width"), "v": mean(full, "v_mean_width")},
                         "sliding_layers_mean_width": {"k": mean(sliding, "k_mean_width"),
                                                       "v": mean(sliding, "v_mean_width")},
                         "layers": layers})
            print({k: v for k, v in rows[-1].items() if k != "layers"}, flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gemma3-270m", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
