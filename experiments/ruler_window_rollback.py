"""What the RULER suite's old crop did to the presets' answers: the same context answered with the fp16 window
rolled back exactly (`CompressedCache.rollback`, what `ruler_eval` does now) and with the crop it used before.

Before the rollback, each batch of questions was cropped off the context; that left the context's last tokens in
their codes, because the question had overwritten their fp16 copies in the window, so every batch after the first
read them quantized. This script answers the questions of one context both ways, on one dense prefill, and
compares each answer with the other and with the answer the committed log holds for it
(`benchmarks/results/ruler_answers.jsonl`, made with the crop: the check that the old way is reproduced).

    python experiments/ruler_window_rollback.py [--model qwen2.5-coder-0.5b]
        [--recipe out/models/qwen2.5-coder-0.5b/recipe] [--length 4096] [--sample 0] [--methods q3.5]
        [--json experiments/results/ruler_window_rollback.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine  # noqa: E402

from kvsqueeze.cache.store import KVStore  # noqa: E402
from kvsqueeze.eval import ruler_eval as R  # noqa: E402
from kvsqueeze.eval.ruler import LAYOUTS, build_contexts  # noqa: E402
from kvsqueeze.eval.texts import load_text  # noqa: E402
from kvsqueeze.methods import parse_methods  # noqa: E402
from kvsqueeze.methods.budget import recipe_windows  # noqa: E402
from kvsqueeze.methods.spec import PRESETS  # noqa: E402


def cropped_answer(self, cache, ids, limits):
    """`_Method.answer` as it was before the rollback: the answer's tokens cropped off, the window repacked
    from what was left of it."""
    start, rows = cache.get_seq_length(), ids.shape[0]
    if rows > 1:
        cache.batch_repeat_interleave(rows)
    try:
        return _answer_rows(self, cache, ids, limits)
    finally:
        cache.crop(start - cache.get_seq_length())
        if rows > 1:
            cache.batch_select_indices(torch.zeros(1, dtype=torch.long))


def _answer_rows(self, cache, ids, limits):
    import contextlib

    with contextlib.ExitStack() as stack:
        stack.enter_context(R.skinny_linears(self.model))
        if self.real and self.spec.quantized:
            from kvsqueeze.integrations.fused import fused_decode

            stack.enter_context(fused_decode(self.model, cache))
        return R.greedy_rows(self.model, self.tok, cache, ids, limits)



def _logged(path: str, names: list[str]) -> dict:
    """The committed log's answers of these methods, by (method, question), and by (method, question without its
    context digest) for the keys this script wrote before answers named their context (one answer each, or an
    error: a log holding one question over two contexts cannot be matched by those keys)."""
    wanted = {n.lower() for n in names}
    out = {}
    for a in R.AnswerLog(path).answers:
        if a.method in wanted:
            out[(a.method, a.question)] = a
            legacy = (a.method, a.question[:-1])
            if legacy in out and out[legacy].question != a.question:
                raise SystemExit(f"{path} holds {legacy} over two contexts: rows without a context digest cannot be "
                                 "matched; run this script again (without --compare-only)")
            out[legacy] = a
    return out


def _compare_with_log(out: dict, path: str) -> dict:
    logged = _logged(path, out["methods"])
    for r in out["rows"]:
        old = logged.get((r["method"], tuple(r["key"])))
        r["logged"] = None if old is None else old.answer
    out["logged"] = sum(r["logged"] is not None for r in out["rows"])
    out["crop_equals_log"] = sum(r["crop"] == r["logged"] for r in out["rows"] if r["logged"] is not None)
    out["rollback_equals_log"] = sum(r["rollback"] == r["logged"] for r in out["rows"] if r["logged"] is not None)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--recipe", default="out/models/qwen2.5-coder-0.5b/recipe")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--samples", type=int, default=4, help="the run's --samples (contexts are seeded by it)")
    ap.add_argument("--layout", default="many", choices=LAYOUTS)
    ap.add_argument("--methods", default="q3.5")
    ap.add_argument("--answers", default=str(ROOT / "benchmarks" / "results" / "ruler_answers.jsonl"))
    ap.add_argument("--prefills", default="out/ruler-window-prefill")
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "ruler_window_rollback.json"))
    ap.add_argument("--compare-only", action="store_true",
                    help="compare the JSON's answers with the log again, without answering anything")
    args = ap.parse_args()
    if args.compare_only:
        out = json.loads(Path(args.json).read_text())
        out = _compare_with_log(out, args.answers)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print({k: v for k, v in out.items() if k != "rows"})
        return

    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.recipe import Recipe

    names = args.methods.split(",")
    recipe = Recipe.load(args.recipe)
    specs = parse_methods(args.methods, context=args.length, layer_windows=recipe_windows(recipe))
    labels = {s.name: n.lower() for s, n in zip(specs, names) if n.lower() in PRESETS}
    model, tok = load_model(args.model, "float32")
    contexts = [c for c in build_contexts(tok, load_text("bbc").evaluation, args.length, args.samples, seed=0,
                                          layout=args.layout) if c.sample == args.sample]
    runs, seconds = {}, {}
    for mode in ("rollback", "crop"):
        t0 = time.perf_counter()
        if mode == "crop":  # the old way: crops let through, the window repacked from what is left
            R._Method.answer, KVStore.crop_blocker = cropped_answer, lambda self, tokens: None
        answers = R.ruler_eval(model, tok, specs, contexts, recipe, model_name=args.model, progress=True,
                               labels=labels, prefill_store=args.prefills)
        runs[mode] = {a.question: a for a in answers}
        seconds[mode] = round(time.perf_counter() - t0, 1)
    logged = _logged(args.answers, names)
    rows = []
    for key, a in runs["rollback"].items():
        b, old = runs["crop"][key], logged.get((a.method, key))
        rows.append({"key": list(key), "method": a.method, "task": a.task, "item": a.item, "rollback": a.answer,
                     "crop": b.answer, "logged": None if old is None else old.answer, "score_rollback": a.score,
                     "score_crop": b.score})
    n = len(rows)
    out = {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "length": args.length,
        "sample": args.sample, "layout": args.layout, "methods": names, "seconds": seconds,
        "questions": n,
        "answers_differ": sum(r["rollback"] != r["crop"] for r in rows),
        "scores_differ": sum(r["score_rollback"] != r["score_crop"] for r in rows),
        "score_rollback": round(100 * sum(r["score_rollback"] for r in rows) / max(n, 1), 2),
        "score_crop": round(100 * sum(r["score_crop"] for r in rows) / max(n, 1), 2),
        "rows": rows,
    }
    out = _compare_with_log(out, args.answers)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print({k: v for k, v in out.items() if k != "rows"})


if __name__ == "__main__":
    main()
