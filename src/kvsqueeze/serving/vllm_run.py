"""Run prompts through vLLM's engine, with kvsqueeze's backend or vLLM's own, and write what came out as JSON.

Runs in vLLM's environment (`make vllm-setup`), one engine per process:

    .venv-vllm/bin/python -m kvsqueeze.serving.vllm_run --model DIR --backend kvsqueeze --recipe out/recipe \
        --prompts prompts.json --max-tokens 16 --out result.json

`--prompts`: a JSON list of token-id lists (so both sides tokenize nothing) or of strings. The JSON holds each
prompt's greedy tokens, the token slots vLLM's allocator reports for the KV space (`kv_tokens`, `num_blocks`,
`block_size`), the KV bytes, and wall times; with `--concurrent` every prompt is submitted at once (continuous
batching) and the throughput is measured over the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def kv_space(llm) -> dict:
    """The KV space the engine made: its blocks, the block size of the KV group with the most layers (the
    model's layers; with kvsqueeze's fp16 window a second group holds the window's pages, from the same blocks),
    the token slots those blocks give that group, every group's block size and layers, and vLLM's own count of
    the tokens it can hold for requests of the longest length (`kv_cache_size_tokens`: every group's pages a
    request takes counted)."""
    cache = llm.llm_engine.vllm_config.cache_config
    groups = []
    try:  # the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        groups = [{"block_size": g.kv_cache_spec.block_size, "layers": len(g.layer_names)}
                  for g in config.kv_cache_groups]
    except AttributeError:
        pass
    block = max(groups, key=lambda g: g["layers"])["block_size"] if groups else cache.block_size
    return {"block_size": block, "num_blocks": cache.num_gpu_blocks, "kv_tokens": cache.num_gpu_blocks * block,
            "kv_cache_groups": groups, "kv_tokens_vllm": getattr(cache, "kv_cache_size_tokens", None)}


class Preemptions:
    """Counts the requests the engine's scheduler preempts (its pages freed, the request queued again to compute
    its tokens anew), where the engine core runs in this process; `count` is None where it does not (its scheduler
    is in another process)."""

    def __init__(self, llm):
        self.count = None
        try:
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            preempt = scheduler._preempt_request
        except AttributeError:
            return
        self.count = 0

        def counted(*args, **kwargs):
            self.count += 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted


def _numba_layer() -> str | None:
    """The threading layer numba's parallel kernels ran on in this process (None: none ran)."""
    numba = sys.modules.get("numba")
    try:
        return numba.threading_layer() if numba is not None else None
    except ValueError:  # no parallel kernel launched
        return None


def kernel_variants() -> dict[str, int]:
    """How many typed variants each of kvsqueeze's numba kernels has in this process (compiled or loaded from
    numba's cache): a variant first needed inside a request is compiled there, on a fresh install."""
    numba = sys.modules.get("numba")
    if numba is None:
        return {}
    out = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("kvsqueeze.kernels.numba.") and module is not None:
            for attr, value in vars(module).items():
                if isinstance(value, numba.core.registry.CPUDispatcher) and value.signatures:
                    out[f"{name.rsplit('.', 1)[1]}.{attr}"] = len(value.signatures)
    return out


def record_prompt_logits(llm) -> None:
    """Keep the whole log-softmax of every prompt position the engine scores (the logits `prompt_logprobs` are
    taken from, float32 [positions, vocab]), in the worker of this process, until `take_prompt_logits`: vLLM
    returns only the top-k of each position, and KL divergence needs every token's probability. Only the model's
    logits computed while the runner builds prompt logprobs are kept, not those of sampling."""
    import torch

    def install(worker):
        runner = worker.model_runner
        model = runner.get_model()
        kept, state = [], {"on": False}
        logits_of, prompt_dict = model.compute_logits, runner._get_prompt_logprobs_dict

        def compute_logits(hidden, *a, **kw):
            logits = logits_of(hidden, *a, **kw)
            if state["on"]:
                kept.append(torch.log_softmax(logits.float(), dim=-1).cpu())
            return logits

        def prompt_logprobs_dict(*a, **kw):
            state["on"] = True
            try:
                return prompt_dict(*a, **kw)
            finally:
                state["on"] = False

        model.compute_logits = compute_logits
        runner._get_prompt_logprobs_dict = prompt_logprobs_dict
        runner._kvsqueeze_prompt_logits = kept

    llm.collective_rpc(install)


def take_prompt_logits(llm):
    """The log-softmax rows kept since the last call, in the order the engine scored them, float32 [rows, vocab]."""
    import torch

    def take(worker):
        kept = worker.model_runner._kvsqueeze_prompt_logits
        rows = torch.cat(kept) if kept else None
        kept.clear()
        return rows

    return llm.collective_rpc(take)[0]


def _score_keeping_logits(llm, i: int, prompt, scoring, folder: str | None):
    """Score one prompt and save its whole log-softmax rows to `folder/prompt_<i>.npy` (None: not saved), after
    checking them against the log-probabilities the engine returned for the prompt's tokens (the same rows, or it
    refuses)."""
    import numpy as np

    (out,) = llm.generate([prompt], scoring, use_tqdm=False)
    rows = take_prompt_logits(llm)
    ids = out.prompt_token_ids
    if rows is None or rows.shape[0] != len(ids) - 1:
        sys.exit(f"prompt {i}: kept {None if rows is None else rows.shape[0]} rows of logits for {len(ids) - 1} "
                 "scored positions: this vLLM computes prompt logits another way")
    returned = [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    mine = rows[range(len(ids) - 1), ids[1:]].tolist()
    worst = max(abs(a - b) for a, b in zip(returned, mine))
    if worst > 1e-3:
        sys.exit(f"prompt {i}: the kept log-softmax differs from the engine's prompt logprobs by {worst:.3g}")
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        np.save(os.path.join(folder, f"prompt_{i}.npy"), rows.numpy())
    return out


SPINCOUNT = "10000"


def short_spin() -> bool:
    """Let torch's OpenMP threads spin for `SPINCOUNT` turns after a parallel op, not libgomp's default 300,000,
    unless GOMP_SPINCOUNT is set already. The kvsqueeze backend runs its numba kernels on a thread pool of their own
    between torch's ops, and on a CPU with few cores torch's spinning threads take the cores those kernels need.
    `experiments/vllm_step_parts.py` (2 cores, 8 requests of 2,048 tokens and 96 new tokens each, SmolLM2-135M,
    the 3.5-bit preset; one run each): 53.7 s with libgomp's default, 50.4 s at 1,000, 48.8 s at 10,000 and 47.8 s
    at 50,000, the fused decode kernel 2.50 ms a layer against 1.69 at 10,000; vLLM's own backend 25.1-26.5 s
    whatever the setting. libgomp reads it once, as torch loads it: this runs before anything imports torch (for
    `vllm serve`, export it in the shell). Returns whether the setting can still take effect (False once torch is
    loaded)."""
    if "torch" in sys.modules:
        return False
    os.environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
    return True


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a model directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--backend", choices=("kvsqueeze", "vllm"), default="kvsqueeze")
    ap.add_argument("--recipe", help="kvsqueeze's recipe for the model (backend kvsqueeze)")
    ap.add_argument("--method", default=None, help="kvsqueeze method (default: the serving default)")
    ap.add_argument("--decode", default=None, help="kvsqueeze decode kernel: auto, numba, triton, reference")
    ap.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists or strings")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="small values force chunked prefill")
    ap.add_argument("--kv-bytes", type=int, default=1 << 30, help="KV cache space in bytes")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", help="vLLM's flag of that name")
    ap.add_argument("--repeat", type=int, default=1, help="run the prompts this many times (prefix hits)")
    ap.add_argument("--skip-tokenizer-init", action="store_true", help="token-id prompts only: load no tokenizer")
    ap.add_argument("--speculative-ngram", type=int, default=0,
                    help="draft this many tokens a step by prompt lookup (vLLM's ngram speculative decoding)")
    ap.add_argument("--predict", action="store_true",
                    help="teacher-forced: for every prompt token after the first, the token the engine ranks first "
                         "given the tokens before it (prompt logprobs), written as `predicted`")
    ap.add_argument("--score", action="store_true",
                    help="teacher-forced scoring: for every prompt token after the first, its log-probability given "
                         "the tokens before it and the engine's first choice there (prompt logprobs), written as "
                         "`scores` (per prompt: `logprob`, `top1`)")
    ap.add_argument("--logits", default=None,
                    help="with --score: a directory for each prompt's whole log-softmax at every position after the "
                         "first (`prompt_<i>.npy`, float32 [tokens - 1, vocab]), the prompts then scored one at a "
                         "time")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.logits and not args.score:
        sys.exit("--logits needs --score")
    if args.logits and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        sys.exit("--logits reads the engine's worker in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in this process
    short_spin()
    from .settings import numba_for_engine

    numba_for_engine()
    if args.backend == "kvsqueeze":
        if not args.recipe:
            sys.exit("--backend kvsqueeze needs --recipe DIR")
        os.environ["KVSQUEEZE_RECIPE"] = args.recipe
        if args.method:
            os.environ["KVSQUEEZE_METHOD"] = args.method
        if args.decode:
            os.environ["KVSQUEEZE_DECODE"] = args.decode
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(args.prompts).read())
    inputs = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p for p in prompts]
    kwargs = dict(model=args.model, dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_bytes, enable_prefix_caching=not args.no_prefix_caching, seed=0)
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if args.disable_hybrid_kv_cache_manager:
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if args.skip_tokenizer_init:
        kwargs["skip_tokenizer_init"] = True
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.speculative_ngram:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.speculative_ngram,
                                        "prompt_lookup_max": 3}
    if args.backend == "kvsqueeze":
        kwargs["attention_backend"] = "CUSTOM"
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    started = time.perf_counter() - t0
    built = kernel_variants()  # what the backend's warm-up loaded as the model was built
    preempted = Preemptions(llm)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs = []
    if args.predict:
        outs = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        predicted = []
        for o in outs:  # position j: the engine's first choice after tokens[:j] (None for the first token)
            predicted.append([None if lp is None else next(t for t, v in lp.items() if v.rank == 1)
                              for lp in o.prompt_logprobs])
    if args.score:
        t1 = time.perf_counter()
        rounds = []
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        if args.logits:
            record_prompt_logits(llm)
        # every round prefills its prompts anew: vLLM reads no prefix cache for a request with prompt log-probabilities
        # (the greedy rounds below are what reads cached pages); the logits kept are the first round's, as `scores`
        for r in range(args.repeat):
            outs = llm.generate(inputs, scoring, use_tqdm=False) if not args.logits else \
                [_score_keeping_logits(llm, i, p, scoring, args.logits if r == 0 else None)
                 for i, p in enumerate(inputs)]
            scores = []
            for o in outs:  # position j >= 1: log P(token j | tokens < j), the rank-1 token there
                lps = o.prompt_logprobs[1:]  # the engine's own token ids: a prompt given as a string has them too
                scores.append({"logprob": [lp[t].logprob for t, lp in zip(o.prompt_token_ids[1:], lps)],
                               "top1": [next(t for t, v in lp.items() if v.rank == 1) for lp in lps]})
            rounds.append(scores)
        scores = rounds[0]
        score_seconds = round((time.perf_counter() - t1) / len(rounds), 2)
    for _ in range(args.repeat if not (args.predict or args.score) else 0):
        t1 = time.perf_counter()
        before = preempted.count
        outs = llm.generate(inputs, params, use_tqdm=False)
        wall = time.perf_counter() - t1
        runs.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(wall, 3),
                     "generated": sum(len(o.outputs[0].token_ids) for o in outs),
                     "preemptions": None if before is None else preempted.count - before})
    result = {
        **({"predicted": predicted} if args.predict else {}),
        **({"scores": scores, "score_seconds": score_seconds} if args.score else {}),
        **({"score_rounds": rounds} if args.score and args.repeat > 1 else {}),
        "backend": args.backend, "model": args.model, "recipe": args.recipe, "dtype": args.dtype,
        "method": os.environ.get("KVSQUEEZE_METHOD") if args.backend == "kvsqueeze" else None,
        **kv_space(llm), "kv_bytes": args.kv_bytes,
        "start_seconds": round(started, 1), "runs": runs, "numba_threading_layer": _numba_layer(),
        "kernel_variants_in_requests": {k: n - built.get(k, 0) for k, n in kernel_variants().items()
                                        if n > built.get(k, 0)},
    }
    if args.backend == "kvsqueeze":
        from .settings import ServingConfig

        result["method"] = ServingConfig.from_env().spec.name
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "scores", "score_rounds", "predicted")}))


if __name__ == "__main__":
    main()
