"""Why do the bit budgets score below fp16 on Qwen2.5-Coder-0.5B? Is it the simulation, the window, or the budget?

    .venv/bin/python experiments/below_fp16.py [--length 2048] [--windows 2]
        [--methods fp16,q3.5,cache:q3.5,nuq@3.5:chan,nuq@3.5:r32,nuq3-1%,nuq3-1%:r32,cache:nuq3-1%]

`benchmarks/ppl_by_length.py` measured every preset below fp16 on this model (BBC evaluation text), at 2K and
more so at 32K, while `nuq3-1%` lies above it. On the first `--windows` windows of `--length` tokens of the same
evaluation windows, this scores each method teacher-forced through its simulated cache, and `cache:METHOD`
through the compressed cache users run (`cache_for`), against the fp16 cache: the per-token NLL (summed over the
windows), its change, and mean KL divergence. The ablation rows take the preset apart: the budget without its
window (`nuq@3.5:chan`), with a budget per layer only (`nuq@3.5:r32`), and `nuq3-1%` with the preset's window.
Writes experiments/results/below_fp16.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import machine  # noqa: E402

METHODS = "fp16,q3.5,cache:q3.5,nuq@3.5:chan,nuq@3.5:r32,nuq3-1%,nuq3-1%:r32,cache:nuq3-1%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--recipe", default="out/models/qwen2.5-coder-0.5b/recipe")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--methods", default=METHODS)
    ap.add_argument("--json", default="experiments/results/below_fp16.json")
    args = ap.parse_args()

    import torch

    from kvsqueeze.eval.long_ppl import hidden_states, score_window
    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.cache import cache_for
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.integrations.simulate import SimulatedQuantization
    from kvsqueeze.methods import preset_for
    from kvsqueeze.methods.budget import recipe_windows
    from kvsqueeze.recipe import Recipe

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    # the windows benchmarks/ppl_by_length.py scores at this length (65,536 evaluation tokens spread evenly)
    ew = evaluation_windows(tok, load_text("bbc"), args.length, max(1, 65536 // args.length))
    fp16 = preset_for("fp16", 2, ())
    totals: dict[str, dict] = {}
    per_window = []
    for w in range(args.windows):
        ids = ew.ids[w].view(1, -1)
        with SimulatedQuantization(model, fp16, recipe) as sim:
            reference = hidden_states(model, ids, sim.new_cache())
        for m in methods:
            engine = m.startswith("cache:")
            name = m.split(":", 1)[1] if engine else m
            spec = preset_for(name, args.length, recipe_windows(recipe))
            t0 = time.perf_counter()
            if engine:
                hidden = hidden_states(model, ids, cache_for(model, recipe, spec))
            elif name == "fp16":
                hidden = reference
            else:
                with SimulatedQuantization(model, spec, recipe) as sim:
                    hidden = hidden_states(model, ids, sim.new_cache())
            s = score_window(model, ids, hidden, reference, 1024)
            t = totals.setdefault(m, {"resolved": spec.name, "nll_sum": 0.0, "tokens": 0, "kld_sum": 0.0})
            t["nll_sum"] += sum(s.nll)
            t["tokens"] += sum(s.tokens)
            t["kld_sum"] += s.kld_sum
            per_window.append({"window": w, "method": m, "resolved": spec.name,
                               "nll": round(sum(s.nll) / sum(s.tokens), 6),
                               "seconds": round(time.perf_counter() - t0, 1)})
            print(per_window[-1], flush=True)
    base = totals["fp16"]["nll_sum"] / totals["fp16"]["tokens"]
    rows = [{"method": m, "resolved": t["resolved"], "nll": round(t["nll_sum"] / t["tokens"], 6),
             "delta_ppl_pct": round(100 * (math.exp(t["nll_sum"] / t["tokens"] - base) - 1), 3),
             "kld_mean": round(t["kld_sum"] / t["tokens"], 5), "tokens": t["tokens"]} for m, t in totals.items()]
    out = {"model": args.model, "recipe": args.recipe, "text": "bbc (evaluation part)", "length": args.length,
           "windows": args.windows, "machine": machine(), "rows": rows, "per_window": per_window}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        print(f"{r['method']:16s} {r['resolved']:28s} NLL {r['nll']:.5f} {r['delta_ppl_pct']:+.3f}% "
              f"KL {r['kld_mean']:.5f}")


if __name__ == "__main__":
    main()
