"""Does a recipe calibrated today answer RULER questions as the recipe behind the logged answers did?

The RULER run (`benchmarks/ruler.py`) adds samples over several days, and a recipe directory may be calibrated
again in between (a new machine, a clean checkout). The answers of its quantized methods depend on the recipe,
so before new samples join the old ones this re-answers one logged context with the recipe given and counts how
many answers come out the same text as the log holds (fp16's answers do not depend on a recipe; they are asked
again as a control of the rest of the arithmetic).

    python experiments/ruler_recipe_check.py --model qwen2.5-coder-0.5b \
        --recipe out/models/qwen2.5-coder-0.5b/recipe --length 4096 --sample 0 --methods fp16,q3.5 \
        [--json experiments/results/ruler_recipe_check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

from kvsqueeze.eval.ruler import build_contexts  # noqa: E402
from kvsqueeze.eval.ruler_eval import AnswerLog, ruler_eval  # noqa: E402
from kvsqueeze.eval.texts import load_text  # noqa: E402
from kvsqueeze.methods import PRESETS, preset_for  # noqa: E402
from kvsqueeze.methods.budget import recipe_windows  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--recipe", default="out/models/qwen2.5-coder-0.5b/recipe")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--samples", type=int, default=4, help="samples the logged run built its contexts for")
    ap.add_argument("--layout", default="many")
    ap.add_argument("--methods", default="fp16,q3.5")
    ap.add_argument("--answers", default="benchmarks/results/ruler_answers.jsonl")
    ap.add_argument("--json", default="experiments/results/ruler_recipe_check.json")
    args = ap.parse_args()

    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.recipe import Recipe

    logged = AnswerLog(args.answers)
    model, tok = load_model(args.model, "float32")
    contexts = [c for c in build_contexts(tok, load_text("bbc").evaluation, args.length, args.samples, seed=0,
                                          layout=args.layout) if c.sample == args.sample]
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    recipe = Recipe.load(args.recipe)
    specs = [preset_for(n, args.length, recipe_windows(recipe)) for n in names]
    labels = {s.name: n.lower() for s, n in zip(specs, names) if n.lower() in PRESETS}
    t0 = time.perf_counter()
    fresh = ruler_eval(model, tok, specs, contexts, recipe, model_name=args.model, labels=labels,
                       log=AnswerLog(None), prefill_store=None)
    old = {a.key: a for a in logged.answers}
    rows = []
    for name in names:
        mine = [a for a in fresh if a.method == name.lower()]
        pairs = [(a, old[a.key]) for a in mine if a.key in old]
        rows.append({"method": name, "compared": len(pairs), "same_text": sum(a.answer == b.answer for a, b in pairs),
                     "same_score": sum(a.score == b.score for a, b in pairs),
                     "score_now": round(100 * sum(a.score for a, _ in pairs) / max(len(pairs), 1), 2),
                     "score_logged": round(100 * sum(b.score for _, b in pairs) / max(len(pairs), 1), 2)})
    meta = json.loads((Path(args.recipe) / "recipe.json").read_text())
    result = {"model": args.model, "recipe": args.recipe, "recipe_tensors_sha256": meta.get("tensors_sha256"),
              "recipe_settings": meta.get("settings"), "length": args.length, "sample": args.sample,
              "layout": args.layout, "rows": rows, "seconds": round(time.perf_counter() - t0, 1),
              "machine": machine()}
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
