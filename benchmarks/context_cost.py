"""What a generated token costs as the context grows: kvsqueeze's caches against llama.cpp's KV cache types.

    python benchmarks/context_cost.py [--contexts 1024,2048,4096,8192,16384,32768] [--new 12]
        [--methods nuq3-1%,q3.5] [--llama-types f16,q8_0,q4_0] [--recipe out/recipe]
        [--json benchmarks/results/context_cost.json]

Per context length L, the default model (SmolLM2-135M) reads the first L tokens of the BBC evaluation part,
then `--new` more tokens of that text one at a time (teacher-forced, so every engine does the same work), and
each token's wall time is kept; a row is the median over them (the first two dropped as warm-up):

* HF transformers (fp32 weights, 2 threads): `DynamicCache` and `StaticCache` (bf16 would be slower on this
  CPU), and kvsqueeze's compressed cache with the fused numba decode for each of `--methods` (presets chosen for
  L). All of them hold the keys and values of one exact prefill of the prompt (`integrations.prefill`), so one
  prefill per length serves them all;
* llama.cpp through llama-cpp-python (the same GGUF weights the HF model was converted from, flash attention
  on, 2 threads) with its f16, q8_0 and q4_0 K and V caches; its own prefill.

The JSON keeps every row and, per engine and cache, a least-squares line of ms per token against the context:
its slope (ms per 1,000 tokens of context: what the cache costs as it grows) and intercept (the weights'
cost). The engines' intercepts differ (fp32 matrix products against llama.cpp's quantized ones), so the slope is
what compares the caches. Rows are written as each length finishes; a rerun with the same --json keeps the
lengths it has.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402

LLAMA_TYPES = {"f16": "F16", "q8_0": "Q8_0", "q4_0": "Q4_0"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--recipe", default="out/recipe")
    p.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--new", type=int, default=12, help="tokens timed after each prompt (the first two warm up)")
    p.add_argument("--methods", default="nuq3-1%,q3.5")
    p.add_argument("--llama-types", default="f16,q8_0,q4_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "context_cost.json"))
    return p.parse_args(argv)


def _median_ms(times: list[float]) -> float:
    return round(1e3 * statistics.median(times[2:] if len(times) > 4 else times), 3)


@torch.no_grad()
def hf_rows(model, recipe, ids: torch.Tensor, length: int, methods: list[str], new: int) -> list[dict]:
    from transformers import DynamicCache, StaticCache

    from kvsqueeze.integrations.fused import fused_decode
    from kvsqueeze.integrations.prefill import dense_prefill, filled_cache
    from kvsqueeze.integrations.preflight import model_windows
    from kvsqueeze.methods import preset_for

    prompt, follow = ids[:, :length], ids[:, length: length + new]
    t0 = time.perf_counter()
    prefill = dense_prefill(model, prompt)
    prefill_s = time.perf_counter() - t0
    b, t = prompt.shape
    shape = prefill.post_keys[0].shape  # [B, H, T, D]

    def dense(kind: str):
        cache = (DynamicCache(config=model.config) if kind == "DynamicCache"
                 else StaticCache(config=model.config, max_cache_len=length + new + 1))
        for i in range(len(prefill.post_keys)):
            values = prefill.values[i].view(b, t, shape[1], shape[3]).transpose(1, 2)
            cache.update(prefill.post_keys[i], values, i, {"cache_position": torch.arange(t)})
        return cache

    rows = []
    caches = [(kind, lambda kind=kind: (dense(kind), None)) for kind in ("DynamicCache", "StaticCache")]
    for name in methods:
        spec = preset_for(name, length, model_windows(model))
        caches.append((f"kvsqueeze {name}", lambda spec=spec: (filled_cache(model, recipe, spec, prefill), spec)))
    for label, make in caches:
        cache, spec = make()
        times = []
        ctx = fused_decode(model, cache) if spec is not None else _Null()
        with ctx:
            for i in range(new):
                t1 = time.perf_counter()
                model(follow[:, i: i + 1], cache=cache, use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - t1)
        if hasattr(cache, "close"):
            cache.close()
        rows.append({"engine": "transformers (fp32 weights)", "cache": label, "context": length,
                     **({"method": spec.name} if spec is not None else {}),  # a preset as chosen for this length
                     "ms_per_token": _median_ms(times), "tokens_timed": len(times),
                     "shared_prefill_s": round(prefill_s, 1)})
        print(rows[-1], flush=True)
    return rows


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def llama_rows(model_name: str, ids: torch.Tensor, length: int, types: list[str], new: int,
               threads: int) -> list[dict] | str:
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (`pip install llama-cpp-python==0.3.36`): no llama.cpp rows"
    import llama_cpp

    from kvsqueeze.integrations.loading import _bundled_gguf

    prompt, follow = ids[0, :length].tolist(), ids[0, length: length + new].tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _bundled_gguf(model_name.lower(), Path(tmp))
        for name in types:
            kind = LLAMA_TYPES[name]
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=length + new + 8, n_batch=512, n_ubatch=512,
                                  n_threads=threads, flash_attn=True, verbose=False, seed=0,
                                  type_k=getattr(llama_cpp, f"GGML_TYPE_{kind}"),
                                  type_v=getattr(llama_cpp, f"GGML_TYPE_{kind}"))
            t0 = time.perf_counter()
            llm.eval(prompt)
            prefill_s = time.perf_counter() - t0
            times = []
            for tok in follow:
                t1 = time.perf_counter()
                llm.eval([tok])
                times.append(time.perf_counter() - t1)
            rows.append({"engine": f"llama.cpp {llama_cpp.__version__} (GGUF weights, flash attention)",
                         "cache": f"llama.cpp {name}", "context": length, "ms_per_token": _median_ms(times),
                         "tokens_timed": len(times), "prefill_s": round(prefill_s, 1)})
            print(rows[-1], flush=True)
            del llm
    return rows


def fits(rows: list[dict]) -> dict:
    """Per cache: least-squares ms per token = intercept + slope * context (slope per 1,000 tokens)."""
    out = {}
    for cache in dict.fromkeys(r["cache"] for r in rows):
        pts = [(r["context"] / 1000, r["ms_per_token"]) for r in rows if r["cache"] == cache]
        if len(pts) < 2:
            continue
        mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        out[cache] = {"slope_ms_per_1k_tokens": round(slope, 4), "intercept_ms": round(my - slope * mx, 3),
                      "contexts": [int(1000 * x) for x, _ in pts]}
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))  # the kernels get what the others get
    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.recipe import Recipe

    contexts = [int(x) for x in args.contexts.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    types = [t for t in args.llama_types.split(",") if t]
    unknown = [t for t in types if t not in LLAMA_TYPES]
    if unknown:
        raise SystemExit(f"--llama-types: unknown {', '.join(unknown)}; known: {', '.join(LLAMA_TYPES)}")
    out = Path(args.json)
    payload = json.loads(out.read_text()) if out.exists() else {"rows": []}
    here = {"machine": machine(), "model": args.model, "recipe": args.recipe, "threads": args.threads,
            "new_tokens": args.new}
    if payload["rows"]:  # a run adds lengths to the file's, measured as its were, or starts another file
        differ = "; ".join(f"{k} {payload.get(k)!r}, here {v!r}" for k, v in here.items() if payload.get(k) != v)
        if differ:
            raise SystemExit(f"{out} was measured with other settings ({differ}): its slopes would mix the two; "
                             "run with those, or with --json of a new file")
    wanted = {"DynamicCache", "StaticCache", *(f"kvsqueeze {m}" for m in methods)}  # llama.cpp's may be missing
    have = {n for n in {r["context"] for r in payload["rows"]}
            if wanted <= {r["cache"] for r in payload["rows"] if r["context"] == n}}  # every cache asked for there
    model, tok = load_model(args.model, "float32", "cpu")
    recipe = Recipe.load(args.recipe)
    ids = tok(load_text("bbc").evaluation, return_tensors="pt")["input_ids"]
    if ids.shape[1] < max(contexts) + args.new:
        raise SystemExit(f"the BBC evaluation part has {ids.shape[1]} tokens; the longest context needs "
                         f"{max(contexts) + args.new}")
    payload |= {"machine": machine(), "model": args.model, "text": "bbc (evaluation part), teacher-forced",
                "recipe": args.recipe, "threads": args.threads, "new_tokens": args.new,
                "timing": "wall ms of each single-token forward (llama.cpp: eval of one token), median over "
                          "the tokens after the first two"}
    for length in contexts:
        if length in have:
            continue
        rows = hf_rows(model, recipe, ids, length, methods, args.new)
        llama = llama_rows(args.model, ids, length, types, args.new, args.threads)
        if isinstance(llama, str):
            payload["llama_cpp"] = llama
        else:
            rows += llama
        fresh = {r["cache"] for r in rows}  # a length measured again replaces its rows of the same caches
        kept = [r for r in payload["rows"] if r["context"] != length or r["cache"] not in fresh]
        payload["rows"] = sorted(kept + rows, key=lambda r: (r["context"], r["cache"]))
        payload["fits"] = fits(payload["rows"])
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=1) + "\n")
    for cache, f in payload.get("fits", {}).items():
        print(f"{cache:>48}: {f['slope_ms_per_1k_tokens']:7.3f} ms per 1K tokens of context, "
              f"{f['intercept_ms']:7.2f} ms at none")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
