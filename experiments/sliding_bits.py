"""What the presets hold on Gemma-3-270M when its sliding-window layers are charged for what they hold.

Gemma-3's local layers (15 of 18, 512-token windows) keep their last 511 tokens. Bit budgets once charged every
layer as if it held every token, so their choices spread each layer's fixed costs (fp16 window, sinks, scales,
codebooks, tables) over 2,048 tokens where a local layer holds 511. For each transfer recipe (`out/transfer/
gemma3-270m/{bbc,mix}`, `benchmarks/transfer.py`) and preset at 2,048 tokens this prints and writes: the bits
the old choice claimed, the bits it holds per element the cache holds (every layer counted at its held tokens,
keys' outliers at the budget's headroom), and the bits of the choice made now (or why none can be made).
No model weights are loaded (the windows come from the model's config).

    python experiments/sliding_bits.py [--json experiments/results/sliding_bits.json]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="experiments/results/sliding_bits.json")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()

    from transformers import AutoConfig
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    from kvsqueeze.integrations.loading import resolve_model_path
    from kvsqueeze.methods import MethodError
    from kvsqueeze.methods import budget as B
    from kvsqueeze.methods.spec import preset_for
    from kvsqueeze.recipe import Recipe

    cfg = AutoConfig.from_pretrained(resolve_model_path("gemma3-270m"))
    cfg = getattr(cfg, "text_config", cfg)
    windows = [int(layer.sliding_window) if isinstance(layer, DynamicSlidingWindowLayer) else None
               for layer in DynamicCache(config=cfg).layers]
    rows = []
    for calib in ("bbc", "mix"):
        recipe = Recipe.load(f"out/transfer/gemma3-270m/{calib}")
        blind, real = copy.deepcopy(recipe), copy.deepcopy(recipe)
        blind.meta["model"]["fingerprint"]["layer_windows"] = [None] * len(windows)
        real.meta["model"]["fingerprint"]["layer_windows"] = windows
        fp = recipe.meta["model"]["fingerprint"]
        channels = fp["kv_heads"] * fp["head_dim"]
        for name in ("q4.5", "q3.5", "q2.5"):
            spec = preset_for(name, args.tokens, ())  # the 32-token window of the presets measured then
            B._COMPUTED.clear()
            old = B.allocate_channels(blind, spec.budget, spec.sinks, tokens=args.tokens, window=spec.window)
            hold = B._Holding.of(real, args.tokens, spec.sinks)
            spent = sum(B.unit_bits(kv, c, n, channels, s)
                        for k, v, n, s in zip(old.keys, old.values, hold.held, hold.kept)
                        for kv, c in (("k", k), ("v", v)))
            row = {"calib_text": calib, "preset": name, "resolved": spec.name, "tokens": args.tokens,
                   "old_choice_claimed": round(old.bits, 4),
                   "old_choice_held": round(B._average(spent, hold, channels, spec.sinks, spec.window), 4)}
            try:
                row["new_choice_held"] = round(B.allocate_channels(real, spec.budget, spec.sinks, tokens=args.tokens,
                                                                   window=spec.window).bits, 4)
            except MethodError as exc:
                row["new_choice_refused"] = str(exc)
            rows.append(row)
            print(row, flush=True)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": "gemma3-270m", "layer_windows": windows, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
