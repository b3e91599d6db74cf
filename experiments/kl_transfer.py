"""Whether a budget weighed by measured sensitivities (`:kl`) loses less off its calibration text, chosen on
calibration parts only.

    python experiments/kl_transfer.py --model gemma3-270m --recipe out/exp/gemma_bbc_kl [--texts bbc,code]
        [--methods nuq@3.5:r8:chan,nuq@3.5:r8:kl:chan] [--windows 4] [--json experiments/results/kl_transfer.json]

A `:kl` method reads measured sensitivities, which `kvsqueeze budget --recipe R` adds to the recipe (a recipe
without them is refused for it; other methods do not need them). For each text,
`--windows` windows of 2,048 tokens spread over that text's calibration part (its evaluation part, which
`benchmarks/transfer.py` scores, is never read): PPL, its change against fp16 with a paired 95% interval, the
mean KL divergence from fp16 and the stored bits, per method. Every method tried is reported. `--methods` takes
any methods the recipe serves: with `--methods nuq@3.5:r8:chan:kslots16` (key outliers capped per token at the count
the budget charges) and a recipe without sensitivities, the same windows say what such a cap costs off the
calibration text (`experiments/results/kslots_transfer_gemma.json`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import evaluate
from kvsqueeze.eval.texts import calibration_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--texts", default="bbc,code")
    ap.add_argument("--methods", default="nuq@3.5:r8:chan,nuq@3.5:r8:kl:chan")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--json", default="experiments/results/kl_transfer.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    recipe = Recipe.load(args.recipe)
    names = ["fp16"] + [m for m in args.methods.split(",") if m]
    specs = [parse_method(n) for n in names]  # a bad name fails before the model loads
    model, tok = load_model(args.model)
    payload = {"model": args.model, "recipe": args.recipe, "recipe_text": recipe.meta.get("text"),
               "seqlen": args.seqlen, "windows": args.windows, "machine": machine(), "methods_tried": names[1:],
               "texts": {}}
    score_texts(model, tok, recipe, names, specs, args.texts, args.windows, args.seqlen, payload, args.json)


def score_texts(model, tok, recipe, names, specs, texts: str, windows: int, seqlen: int, payload: dict,
                json_path: str) -> None:
    """Score `specs` (the first fp16) on `windows` windows of each of `texts`' calibration parts into
    payload["texts"], writing `json_path` as each text finishes."""
    for text in [t for t in texts.split(",") if t]:
        t0 = time.perf_counter()
        ids = calibration_windows(tok, load_text(text).calibration, windows, seqlen)
        rows = evaluate(model, ids, specs, recipe)
        base = rows[0].ppl
        out = []
        for name, r in zip(names, rows):
            out.append({**r.as_dict(), "change_pct": round(100 * (r.ppl / base - 1), 4)})
            print(f"{text:5s} {name:36s} {r.avg_bits:.3f} bits  {out[-1]['change_pct']:+.3f}%  "
                  f"KLD {r.kld_mean:.5f}", flush=True)
        payload["texts"][text] = {"part": "calibration", "seconds": round(time.perf_counter() - t0, 1), "rows": out}
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {json_path}")


if __name__ == "__main__":
    main()
