"""Tensor parallelism through vLLM's engine: the served method's perplexity on one rank and on several, same tokens.

    python benchmarks/vllm_tp.py [--model smollm2-135m] [--recipe out/recipe] [--method q3.5] [--ranks 3]
        [--text bbc] [--windows 8] [--length 2048] [--block-size 128] [--max-num-batched-tokens N]
        [--json benchmarks/results/vllm.json]

Windows of `--length` tokens of the evaluation text are scored teacher-forced (`vllm_run --score`, float32) by vLLM's
engine with the kvsqueeze backend twice: with one rank, and with `--ranks` tensor-parallel ranks (vLLM's CPU engine
runs each rank in a process of its own, one thread each), each rank holding its share of the KV heads in its pages
(`PageLayout`'s `heads`). The fp16 reference is kvsqueeze's HF path with the fp16 cache on the same windows.

Written under `tensor_parallel` in `--json` (the file's other measurements kept): each run's perplexity and change
from fp16, one rank's change with its paired 95% interval over the windows, whether the several ranks' change
lies inside it, their paired interval against one rank directly, the largest difference of a token's
log-probability between the two, how often their first choices agree, and each rank's page bytes per token.
The ranks exchange each step's new keys and values and encode whole tokens, so the two runs hold the same codes:
what is left between them is the float rounding of vLLM's split matrix products.

The default model's 9 query heads over 3 KV heads admit 3 ranks (not 2); `--ranks 0` takes the smallest count
above one that divides both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, serving_arguments, serving_setup, vllm_engine, write_section  # noqa: E402


def smallest_split(kv_heads: int, heads: int) -> int:
    """The fewest ranks above one that share both the KV heads and the query heads equally."""
    for r in range(2, kv_heads + 1):
        if kv_heads % r == 0 and heads % r == 0:
            return r
    raise SystemExit(f"{kv_heads} KV heads and {heads} query heads admit no tensor parallelism")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(ap)
    ap.add_argument("--ranks", type=int, default=0, help="tensor-parallel ranks (0: the fewest the model admits)")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens a step (vLLM's default if not given): fewer hold fewer logits at once")
    args = ap.parse_args(argv)

    from transformers import DynamicCache

    from kvsqueeze.eval.long_ppl import check_head, hidden_states, score_window
    from kvsqueeze.eval.perplexity import paired_interval
    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.cache import cache_for, kv_shape
    from kvsqueeze.integrations.loading import load_model, resolve_model_path
    from kvsqueeze.serving.settings import ServingConfig

    py, recipe, served = serving_setup(args)
    config = ServingConfig(recipe, served)
    model, tok = load_model(args.model, "float32")
    shape = kv_shape(model.config)
    ranks = args.ranks or smallest_split(shape.kv_heads, int(model.config.num_attention_heads))
    ew = evaluation_windows(tok, load_text(args.text), args.length, args.windows)
    check_head(model, ew.ids[:1], DynamicCache)
    windows = [w.tolist() for w in ew.ids]

    runs = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "windows.json").write_text(json.dumps(windows))
        common = ["--model", resolve_model_path(args.model), "--dtype", "float32", "--max-model-len",
                  str(args.length + 16), "--kv-bytes", str(1 << 30), "--block-size", str(args.block_size),
                  "--prompts", str(tmp / "windows.json"), "--skip-tokenizer-init", "--score", "--backend",
                  "kvsqueeze", "--recipe", recipe, "--method", served]
        if args.max_num_batched_tokens:
            common += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        for r in (1, ranks):
            t0 = time.perf_counter()
            runs[r] = vllm_engine(py, [*common, "--tensor-parallel-size", str(r)], tmp, f"tp{r}",
                                  env={"OMP_NUM_THREADS": str(max(1, 2 // r))})
            runs[r]["wall_seconds"] = round(time.perf_counter() - t0, 1)

    fp16, tokens = [], []
    for ids in ew.ids:
        ids = ids.view(1, -1)
        with cache_for(model, recipe, "fp16") as cache:
            ref = hidden_states(model, ids, cache)
        s = score_window(model, ids, ref, ref, args.length)
        fp16.append(sum(s.nll))
        tokens.append(sum(s.tokens))
    nll = {r: [-sum(s["logprob"]) for s in run["scores"]] for r, run in runs.items()}
    for r, run in runs.items():
        if [len(s["logprob"]) for s in run["scores"]] != tokens:
            raise SystemExit(f"vLLM with {r} rank(s) scored another number of tokens than the HF path")
    count = float(sum(tokens))
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    change = lambda a, b: 100 * math.expm1((sum(a) - sum(b)) / count)  # noqa: E731
    one_ci = paired_interval(t(nll[1]), t(fp16), t(tokens))
    many_change = change(nll[ranks], fp16)
    direct = paired_interval(t(nll[ranks]), t(nll[1]), t(tokens))
    lp = {r: torch.tensor([x for s in run["scores"] for x in s["logprob"]], dtype=torch.float64)
          for r, run in runs.items()}
    agree = sum(a == b for s, q in zip(runs[1]["scores"], runs[ranks]["scores"]) for a, b in zip(s["top1"], q["top1"]))
    def page(rank: int, n: int) -> float:  # a rank's page bytes per token, every layer
        return sum(config.layout(layer, shape.channels, shape.head_dim, args.block_size, rank, n).page_bytes
                   for layer in range(shape.layers)) / args.block_size

    result = {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "method": args.method,
        "served_method": served, "text": f"{args.text}, evaluation part", "windows": len(windows),
        "window_tokens": args.length, "tokens_scored": int(count), "block_size": args.block_size, "dtype": "float32",
        "max_num_batched_tokens": args.max_num_batched_tokens or "vLLM's default",
        "ranks": ranks, "kv_heads": shape.kv_heads, "heads_per_rank": shape.kv_heads // ranks,
        "ppl_fp16_hf": round(math.exp(sum(fp16) / count), 4),
        "one_rank": {"ppl": round(math.exp(sum(nll[1]) / count), 4), "delta_pct": round(change(nll[1], fp16), 3),
                     "ci95": None if one_ci is None else [round(x, 3) for x in one_ci],
                     "page_bytes_per_token": page(0, 1), "kv_tokens": runs[1]["kv_tokens"],
                     "seconds": runs[1]["wall_seconds"]},
        "ranks_run": {"ppl": round(math.exp(sum(nll[ranks]) / count), 4), "delta_pct": round(many_change, 3),
                      "page_bytes_per_token_per_rank": [page(r, ranks) for r in range(ranks)],
                      "kv_tokens_per_rank": runs[ranks]["kv_tokens"], "seconds": runs[ranks]["wall_seconds"]},
        "ppl_inside_one_rank_interval": one_ci is not None and one_ci[0] <= many_change <= one_ci[1],
        "paired_ci95_against_one_rank": None if direct is None else [round(x, 5) for x in direct],
        "max_abs_logprob_diff": float((lp[ranks] - lp[1]).abs().max()),
        "top1_agreement": round(agree / count, 5),
        "how": "one_rank / ranks_run: vLLM with the kvsqueeze backend at --tensor-parallel-size 1 and `ranks`, "
               "teacher-forced prompt logprobs; delta_pct against the HF path's fp16 cache on the same windows; ci95: "
               "one rank's paired 95% interval over windows; paired_ci95_against_one_rank: the several ranks' PPL "
               "change from one rank's, window by window",
    }
    write_section(args.json, "tensor_parallel", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
