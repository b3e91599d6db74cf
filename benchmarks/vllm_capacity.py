"""Capacity turned into throughput: a queue of long requests in a KV space vLLM's own cache holds only a few of.

    python benchmarks/vllm_capacity.py [--model smollm2-135m] [--recipe out/recipe]
        [--method q3.5] [--fit 2] [--queue 8] [--prompt-tokens 2048] [--new-tokens 128]
        [--block-size 128] [--max-num-batched-tokens 256] [--key capacity_bound] [--json benchmarks/results/vllm.json]

The KV space is sized so that vLLM's own bfloat16 cache holds `--fit` requests of `--prompt-tokens` +
`--new-tokens` tokens at once (plus one block); `--queue` such requests (prompts cut from the BBC evaluation text,
greedy) are submitted at once to each engine in turn, bfloat16: vLLM with its default CPU backend, then with the
kvsqueeze backend serving the method, whose pages hold several times more tokens in the same bytes; and vLLM's
own backend again with kvsqueeze's prefill chunk. vLLM's scheduler runs what fits and queues (or preempts, and
later recomputes) the rest. Each engine's preemptions are counted (vLLM's scheduler, in the run's process): a
request preempted when the space runs out mid-generation gives its pages back and computes its prompt and every
token it generated again when it resumes.

Two shapes of queue answer different questions. Long prompts and short answers (the defaults, 2,048 + 128) fill
the space at admission: vLLM admits only what fits whole and never preempts, so the queue measures prefill speed
with more requests in flight. Short prompts and long answers (`--prompt-tokens 256 --new-tokens 768 --key
capacity_bound_long_answers`) are admitted on their prompts' pages and outgrow the space while they decode: vLLM
preempts and recomputes, which a cache holding 4-5 times the tokens avoids.

The prefill chunk (`--max-num-batched-tokens`, tokens a step computes) matters to a method with an fp16 window:
vLLM keeps the window's pages of every token a step computes until the step ends, so a request prefilling a chunk
of M tokens holds about (N - 1 + M) / 16 window pages, each a whole block, while a decoding one holds 3. vLLM's
CPU default (4,096 tokens) makes a 2K prompt reserve 130 window pages; 256 makes it 19. vLLM's own backend runs
at its default chunk (its best) and again at kvsqueeze's, in the same run. Written: requests per second
of each engine over the whole queue and their ratio (`capacity_bound_ratio`), the token slots each engine's
allocator reports for the space (`capacity_bound.capacity_ratio`; the top-level `capacity_ratio` is
`benchmarks/vllm.py`'s, of a 1 GiB space) and of vLLM's own count of the tokens it can hold for
requests of that length (`capacity_ratio_vllm`; with kvsqueeze's fp16 window, the window's pages counted as vLLM
reserves them while a prefill chunk is in flight), and every engine's log under `capacity_bound` in `--json`
(the file's other measurements are kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (chunks_run, engines_against_vllm, faster_vllm, machine, merge_json,  # noqa: E402
                    serving_arguments, serving_setup, vllm_engine)

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(ap)
    ap.add_argument("--fit", type=int, default=2, help="requests vLLM's own bfloat16 cache holds at once")
    ap.add_argument("--queue", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256,
                    help="kvsqueeze's prefill chunk (vLLM's own backend runs at its default and at this)")
    ap.add_argument("--key", default="capacity_bound",
                    help="the section of --json this queue's results go to, and `<key>_ratio` beside it (the default "
                         "section's ratio is `capacity_bound_ratio`, its vLLM count `capacity_ratio_vllm`)")
    args = ap.parse_args(argv)
    if not args.key.isidentifier():
        raise SystemExit(f"--key {args.key!r}: give a name of letters, digits and underscores "
                         "(e.g. capacity_bound_long_answers)")

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.cache import kv_shape
    from kvsqueeze.integrations.loading import load_model, resolve_model_path

    py, recipe, served = serving_setup(args)
    model, tok = load_model(args.model, "float32")
    shape = kv_shape(model.config)
    per_request = args.prompt_tokens + args.new_tokens
    blocks = -(-per_request // args.block_size)
    bf16_block = 2 * 2 * shape.channels * shape.layers * args.block_size  # keys and values, 2 bytes each
    kv_bytes = (args.fit * blocks + 1) * bf16_block
    ids = tok(load_text("bbc").evaluation, add_special_tokens=False).input_ids
    if len(ids) < (20 + args.queue) * args.prompt_tokens:  # a prompt cut past the text's end: shorter, or empty
        raise SystemExit(f"the BBC evaluation part has {len(ids)} tokens; {args.queue} prompts of "
                         f"{args.prompt_tokens} from token {20 * args.prompt_tokens} on need "
                         f"{(20 + args.queue) * args.prompt_tokens}: ask for fewer or shorter ones")
    queue = [ids[(20 + i) * args.prompt_tokens:(21 + i) * args.prompt_tokens] for i in range(args.queue)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "queue.json").write_text(json.dumps(queue))
        # a whole number of blocks: vLLM counts the requests of the longest length its space holds in blocks of
        # max-model-len, so one more token than the blocks a request takes would count a block more per request
        common = ["--model", resolve_model_path(args.model), "--dtype", "bfloat16", "--max-model-len",
                  str(blocks * args.block_size), "--kv-bytes", str(kv_bytes), "--block-size", str(args.block_size),
                  "--prompts", str(tmp / "queue.json"), "--max-tokens", str(args.new_tokens),
                  "--skip-tokenizer-init"]
        kvsqueeze = ["--backend", "kvsqueeze", "--recipe", recipe, "--method", served]
        for name, backend in engines_against_vllm(kvsqueeze, args.max_num_batched_tokens):
            runs[name] = vllm_engine(py, [*common, *backend], tmp, f"capacity-{name}")
    rate = {k: args.queue / r["runs"][0]["seconds"] for k, r in runs.items()}
    best = faster_vllm(rate)  # vLLM's own backend at its faster prefill chunk
    result = {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "served_method": served,
        "dtype": "bfloat16", "kv_space_bytes": kv_bytes, "block_size": args.block_size,
        "max_num_batched_tokens": chunks_run(args.max_num_batched_tokens),
        "requests": args.queue, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "kv_tokens": {k: r["kv_tokens"] for k, r in runs.items()},
        "requests_at_once": {k: r["kv_tokens"] // (blocks * args.block_size) for k, r in runs.items()},
        # vLLM's own count, every KV group a request takes included (a method's fp16 window: its pages while a
        # prefill chunk is in flight), for requests of the longest length
        "kv_tokens_vllm": {k: r.get("kv_tokens_vllm") for k, r in runs.items()},
        "requests_at_once_vllm": {k: (r.get("kv_tokens_vllm") or 0) // per_request for k, r in runs.items()},
        "kv_cache_groups": {k: r.get("kv_cache_groups") for k, r in runs.items()},
        "seconds": {k: r["runs"][0]["seconds"] for k, r in runs.items()},
        # requests the scheduler preempted (None: the engine core ran in another process and was not counted)
        "preemptions": {k: r["runs"][0].get("preemptions") for k, r in runs.items()},
        "requests_per_s": {k: round(v, 4) for k, v in rate.items()},
        # the token slots each engine's allocator gives this space (vLLM.py's top-level capacity_ratio is a 1 GiB
        # space's)
        "capacity_ratio": round(runs["kvsqueeze"]["kv_tokens"] / runs[best]["kv_tokens"], 3),
        "how": "the queue submitted at once to each engine (offline LLM.generate), wall time until every request "
               "finished; the KV space holds `fit` whole requests in vLLM's own bfloat16 cache; the ratios are "
               "against vLLM's own backend at the faster of its two prefill chunks (`baseline`)",
        "baseline": best,
    }
    result["capacity_ratio_vllm"] = round(runs["kvsqueeze"]["kv_tokens_vllm"] / runs[best]["kv_tokens_vllm"], 3)
    result["ratio"] = round(rate["kvsqueeze"] / rate[best], 3)
    parts = {args.key: result, f"{args.key}_ratio": result["ratio"]}
    if args.key == "capacity_bound":  # the keys the serving issue names
        parts["capacity_ratio_vllm"] = result["capacity_ratio_vllm"]
    merge_json(args.json, **parts)
    print(json.dumps({k: v for k, v in result.items() if k != "kv_cache_groups"}, indent=1))
    print(f"{args.key}_ratio", result["ratio"], "capacity_ratio (this space)", result["capacity_ratio"],
          "capacity_ratio_vllm", result["capacity_ratio_vllm"], "preemptions", result["preemptions"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
