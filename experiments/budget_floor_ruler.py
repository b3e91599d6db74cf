"""Does the 3.5-bit budget lose its several-answer RULER questions because it starves the fast RoPE channels?

`budget_by_frequency.py` found that the Fisher budget gives the fastest-turning key channel pairs 1-2 bits.
This probe chooses the same budget again with those channels barred from 1 bit (frequency indices below half,
in every layer and head: their 1-bit error is made larger than any other, so the knapsack never picks it;
everything else, bits included, as the preset) and asks RULER-style questions of contexts built from another
seed than the benchmark's (seed 1, not 0), so that nothing here is chosen on the evaluation questions. fp16,
`nuq3-1%`, the preset and the floored preset answer the same questions from the same exact prefill.

    python experiments/budget_floor_ruler.py [--model qwen2.5-coder-0.5b]
        [--recipe out/models/qwen2.5-coder-0.5b/recipe] [--length 4096] [--samples 2] [--seed 1]
        [--json experiments/results/budget_floor_ruler.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.ruler import build_contexts
from kvsqueeze.eval.ruler_eval import AnswerLog, paired, ruler_eval
from kvsqueeze.eval.texts import load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import preset_for
from kvsqueeze.methods.budget import recipe_windows
from kvsqueeze.methods.budget import spec_allocation
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402

SEVERAL = ("niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")


def floored(recipe: Recipe) -> Recipe:
    """A copy of `recipe` whose key channels of the faster half of the RoPE frequencies cannot take 1 bit (and
    without stored budget choices, so that budgets are chosen again from its errors)."""
    out = copy.copy(recipe)
    out.meta = copy.deepcopy(recipe.meta)
    out.meta.pop("budgets", None)
    d = int(recipe.meta["model"]["fingerprint"]["head_dim"])
    own = recipe.channel_errors

    def channel_errors(layer: int, kv: str, fraction: float) -> torch.Tensor:
        err = own(layer, kv, fraction).clone()
        if kv == "k":
            fast = (torch.arange(err.shape[0]) % d) % (d // 2) < d // 4
            err[fast, 0] = err.max() * 1e6 + 1.0
        return err

    out.channel_errors = channel_errors
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--recipe", default="out/models/qwen2.5-coder-0.5b/recipe")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1, help="not the benchmark's seed (0)")
    ap.add_argument("--answers", default="experiments/results/budget_floor_answers.jsonl")
    ap.add_argument("--json", default="experiments/results/budget_floor_ruler.json")
    args = ap.parse_args()
    if args.seed == 0:
        raise SystemExit("seed 0 builds the benchmark's evaluation contexts: choose on another seed")

    recipe = Recipe.load(args.recipe)
    low = floored(recipe)
    spec = preset_for("q3.5", args.length, recipe_windows(recipe))
    plain, floor = spec_allocation(spec, recipe), spec_allocation(spec, low)
    model, tok = load_model(args.model)
    contexts = build_contexts(tok, load_text("bbc").evaluation, args.length, args.samples, seed=args.seed,
                              layout="many")
    log = AnswerLog(args.answers)
    t0 = time.perf_counter()
    ruler_eval(model, tok, [preset_for(m, args.length, recipe_windows(recipe)) for m in ("fp16", "nuq3-1%", "q3.5")],
               contexts, recipe,
               model_name=args.model, log=log, labels={spec.name: "q3.5"})
    ruler_eval(model, tok, [spec], contexts, low, model_name=args.model, log=log, labels={spec.name: "q3.5-floor"})
    seconds = time.perf_counter() - t0
    answers = [a for a in log.answers if a.length == args.length]
    rows = []
    for group, keep in (("all", lambda t: True), ("one", lambda t: t not in SEVERAL), ("several", SEVERAL.__contains__)):
        for p in paired([a for a in answers if keep(a.task)]):
            rows.append({"questions": group, "method": p.method, "n": p.questions, "score": p.score,
                         "fp16_score": p.reference_score, "diff": p.diff, "ci95": None if p.ci95 is None else list(p.ci95)})
    d = int(recipe.meta["model"]["fingerprint"]["head_dim"])

    def fast_mean(alloc) -> float:
        w = torch.tensor([k.widths for k in alloc.keys], dtype=torch.float64)
        fast = (torch.arange(w.shape[1]) % d) % (d // 2) < d // 4
        return round(float(w[:, fast].mean()), 3)

    result = {"machine": machine(), "model": args.model, "recipe": args.recipe, "length": args.length,
              "samples": args.samples, "seed": args.seed, "resolved": spec.name, "variants_tried": 1,
              "bits": {"q3.5": round(plain.bits, 4), "q3.5-floor": round(floor.bits, 4)},
              "fast_key_width_mean": {"q3.5": fast_mean(plain), "q3.5-floor": fast_mean(floor)},
              "seconds": round(seconds, 1), "paired": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(r)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
