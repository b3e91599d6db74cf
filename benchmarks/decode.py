"""Decode-step attention speed: the fused kernel over the compressed cache against dense SDPA.

Kernel rows: one decode step of attention (one query token) for one layer of
the default model's shape (9 query heads over 3 KV heads, head_dim 64) at each
context length: `kvsqueeze.kernels.decode_attention` over a compressed
store's view, the call a decode step of `generate()` makes (numba backend, and
the pure-torch reference backend) for each method, against torch SDPA
(each KV head's query heads as its query rows, `common.grouped_sdpa`: the
fastest dense call found here, 1.5-1.8x faster than `enable_gqa=True` in fp32;
runs before 2026-12-06 used `enable_gqa=True`) over fp32 and bf16 caches of the
same shape. Before any timing, the fused result is checked against the
reference backend on the very store it is timed on. Every variant is timed once per round, round after round, so a
change of machine load hits them all alike; medians are reported. The order
within a round rotates from round to round: a call right after a dense torch
call (whose threads have just run and filled the caches) is slower than one
right after another fused call, and in a fixed order the variant that always
came first carried that alone. The reference backend (hundreds of ms and
gigabytes of temporaries at long contexts, which leave the next call with
nothing cached) is timed after the other rounds, in a third as many.

The stores hold synthetic pre-RoPE keys and values with heavy tails (Student
t, 5 degrees of freedom) whose per-channel key ranges come from the recipe's
calibrated thresholds (`--recipe`, a middle layer; without one, a synthetic
per-channel quantizer on NormalFloat levels), so about 1% of the elements are
outliers as in real caches. Speed does not depend on the values otherwise.

`--step`: the whole per-layer work of one decode step, what a user waits for:
compress the new token's key and value (quantize, pack, append to the store)
and attend with the fused kernel, against a `DynamicCache` layer's step
(concatenate the new key and value, then SDPA) and a `StaticCache` layer's
(write in place, then SDPA) in float32 and bfloat16. Each timed call follows
at least `--settle-ms` of untimed calls of the same variant: the `DynamicCache`
step allocates and frees its whole cache (50 MB at 32K in float32) every call,
and on this project's VMs the first call after such a free runs about 3.5 ms
slower at 32K, whichever variant it is (idle time in between does not help;
`experiments/decode_step_neighbours.py`); without the settling that cost
landed on the variant that happened to come next in the rotation, and the
fused step at 32K measured 2.3 or 5-8 ms from run to run. Settled, each
variant is timed in its own steady state (the `DynamicCache` step still pays
for its own frees, as it does in a model).

`--e2e`: greedy decoding on the default model after a `--prompt`-token BBC
prompt, decode tokens/s (prefill timed apart) for the compressed cache with
fused decode, `DynamicCache`, `StaticCache` and transformers' `QuantizedCache`
(quanto). With `--e2e-prefill shared` the prompt but its last token is
prefilled once with exact attention (`integrations.prefill.dense_prefill`) and
each cache is filled with those keys and values (the compressed cache
quantizes them as its forward would), then reads the last prompt token and
decodes: the decode speed after a 32K prompt at one prefill's cost instead of
one per cache. A cache filled this way holds what an exact prefill wrote, not
what a prefill through the quantized cache would have, so its tokens may
differ from the `own` run's; what a decode step costs does not.

    python benchmarks/decode.py --contexts 2048,8192,32768,131072 --threads 2 [--layers 8] [--e2e]

The layer shape is the recipe's model's (`--recipe`, default `out/recipe`, which `make demo` writes);
without a recipe pass `--heads`, `--kv-heads` and `--head-dim`.

`--layers N` keeps N distinct copies of every cache and calls them in turn:
once they outgrow the last-level cache, each call reads its cache from
memory, as each of a model's layers does in a real decode step.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.cache.positions import PositionLog
from kvsqueeze.config import DEFAULT_MODEL
from kvsqueeze.kernels import Rope, decode_attention
from kvsqueeze.methods import parse_method

sys.path.insert(0, str(Path(__file__).parent))
from common import (DEFAULT_RECIPE, check, commit, decode_machine, decode_step, fill_store,  # noqa: E402
                    grouped_sdpa, prepare, quantizers, shape)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="2048,8192,32768,131072", help="cached tokens, comma-separated")
    p.add_argument("--methods", default="nuq4-1%,nuq3-1%,nuq2-1%")
    p.add_argument("--heads", type=int, help="query heads (default: the recipe's model's)")
    p.add_argument("--kv-heads", type=int, help="KV heads (default: the recipe's model's)")
    p.add_argument("--head-dim", type=int, help="head width (default: the recipe's model's)")
    p.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    p.add_argument("--rounds", type=int, default=15, help="timing rounds (the reference backend: a third)")
    p.add_argument("--layers", type=int, default=1,
                   help="distinct copies of every cache, called in turn: with enough of them (8 at 32K) they "
                        "outgrow the last-level cache and each call reads its cache from memory, as every layer "
                        "of a real decode step does (default 1: one layer, as warm as the machine keeps it)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE if Path(DEFAULT_RECIPE).exists() else None)
    p.add_argument("--no-reference", action="store_true", help="skip the (slow) reference backend")
    p.add_argument("--e2e", action="store_true", help="also time greedy decoding on the default model")
    p.add_argument("--step", action="store_true", help="time whole per-layer decode steps (append + attention)")
    p.add_argument("--settle-ms", type=float, default=25.0,
                   help="--step: untimed calls of the same variant for at least this long before each timed call")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", type=int, default=8192, help="e2e prompt tokens")
    p.add_argument("--new", type=int, default=32, help="e2e decoded tokens")
    p.add_argument("--e2e-methods", default="nuq3-1%,nuq4-1%")
    p.add_argument("--e2e-prefill", choices=("own", "shared"), default="own",
                   help="own: each cache prefills the prompt itself (timed); shared: one exact prefill of the prompt "
                        "but its last token, handed to every cache (what a long prompt's decode speed needs, at one "
                        "prefill's cost)")
    p.add_argument("--quantized-cache-bits", default="4,2", help="transformers QuantizedCache widths ('' to skip)")
    p.add_argument("--e2e-baselines", default="DynamicCache,StaticCache",
                   help="the transformers caches timed beside kvsqueeze's ('' for none)")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "decode.json"))
    return p.parse_args(argv)


# ---- kernel timing -----------------------------------------------------------------------------------
def reference_rounds(args) -> int:
    """Rounds of the (slow) reference backend, timed after the others: a third as many."""
    return max(1, args.rounds // 3)


def kernel_rows(args, recipe) -> list[dict]:
    hq, h, d = shape(args, recipe)
    c = h * d
    rope, scaling = Rope.default(d), d**-0.5
    rows = []
    for tokens in (int(x) for x in args.contexts.split(",")):
        q = torch.randn(1, hq, d)
        variants = {}
        for i, method in enumerate(args.methods.split(",")):
            kq, vq = quantizers(method, recipe, c, seed=i)
            positions = PositionLog()  # one per cache, as the stores of a generate() cache share theirs
            store = fill_store(kq, vq, tokens, c, d, parse_method(method).sinks, positions, seed=i)
            check(q, store, rope, scaling, method, tokens)
            layers = [store] + [copy.deepcopy(store) for _ in range(args.layers - 1)]  # equal, in distinct memory
            turn = itertools.cycle(layers)

            def fused(turn=turn, q=q, backend="numba"):  # as a decode step of generate()
                decode_attention(q, next(turn).view(), rope, scaling, backend=backend)

            variants[(method, "numba")] = fused
            if not args.no_reference:
                variants[(method, "reference")] = lambda fused=fused: fused(backend="reference")
        for dtype in (torch.float32, torch.bfloat16):
            qd = q.view(1, hq, 1, d).to(dtype)
            kv = [tuple(torch.randn(1, h, tokens, d).to(dtype) for _ in range(2))]
            kv += [(k.clone(), v.clone()) for k, v in kv * (args.layers - 1)]
            turn = itertools.cycle(kv)

            def dense(qd=qd, turn=turn):
                k, v = next(turn)
                grouped_sdpa(qd, k, v, scaling)

            variants[(f"dense-{str(dtype).split('.')[-1]}", "torch-sdpa")] = dense
        times = {key: [] for key in variants}
        for f in variants.values():
            f()  # warm-up (and numba compilation / cache load)
        fast = [key for key in variants if key[1] != "reference"]
        rounds = [fast[r % len(fast):] + fast[: r % len(fast)] for r in range(args.rounds)]  # every place in turn
        rounds += [[key for key in variants if key not in fast]] * reference_rounds(args)  # see the docstring
        for key in itertools.chain.from_iterable(rounds):
            t0 = time.perf_counter()
            variants[key]()
            times[key].append(time.perf_counter() - t0)
        for (method, backend), ts in times.items():
            rows.append({"context": tokens, "method": method, "backend": backend,
                         "median_ms": round(1e3 * statistics.median(ts), 3), "min_ms": round(1e3 * min(ts), 3),
                         "repeats": len(ts)})
            print(f"{tokens:>7} {method:>16} {backend:>10} {rows[-1]['median_ms']:>10.3f} ms")
    return rows


def ratios(rows: list[dict]) -> dict:
    """Median dense fp32 / bf16 SDPA time over each fused method's, per context."""
    out = {}
    for ctx in sorted({r["context"] for r in rows}):
        at = {(r["method"], r["backend"]): r["median_ms"] for r in rows if r["context"] == ctx}
        for (method, backend), ms in at.items():
            if backend == "numba":
                for dense in ("dense-float32", "dense-bfloat16"):
                    out[f"{ctx}: {dense} sdpa / fused {method}"] = round(at[(dense, "torch-sdpa")] / ms, 3)
    return out


# ---- whole decode steps ------------------------------------------------------------------------------
def step_rows(args, recipe) -> list[dict]:
    """One layer's whole decode step: append one token, then attend; each variant restored after each call."""
    hq, h, d = shape(args, recipe)
    c = h * d
    rope, scaling = Rope.default(d), d**-0.5
    rows = []
    g = torch.Generator().manual_seed(7)
    for tokens in (int(x) for x in args.contexts.split(",")):
        q = torch.randn(1, hq, d)
        k1, v1 = torch.randn(1, 1, c, generator=g), torch.randn(1, 1, c, generator=g)
        variants = {}
        for i, method in enumerate(args.methods.split(",")):
            _, fused, reset = decode_step(method, recipe, q, k1, v1, rope, scaling, tokens, seed=i)  # checked
            variants[(method, "append + numba")] = (fused, reset)
        for dtype in (torch.float32, torch.bfloat16):
            keys = torch.randn(1, h, tokens - 1, d).to(dtype)
            values = torch.randn(1, h, tokens - 1, d).to(dtype)
            qd, kn, vn = q.view(1, hq, 1, d).to(dtype), k1.view(1, h, 1, d).to(dtype), v1.view(1, h, 1, d).to(dtype)

            def dense(keys=keys, values=values, qd=qd, kn=kn, vn=vn):  # what DynamicLayer.update + SDPA do
                k, v = torch.cat([keys, kn], dim=-2), torch.cat([values, vn], dim=-2)
                return grouped_sdpa(qd, k, v, scaling)

            variants[(f"dense-{str(dtype).split('.')[-1]}", "cat + torch-sdpa")] = (dense, lambda: None)
            # what StaticCache and serving engines do: the new token written in place into a cache allocated once
            k_all = torch.cat([keys, torch.zeros_like(kn)], dim=-2)  # [1, H, T, D]
            v_all = torch.cat([values, torch.zeros_like(vn)], dim=-2)

            def static(k_all=k_all, v_all=v_all, qd=qd, kn=kn, vn=vn, t=tokens - 1):
                k_all[:, :, t : t + 1].copy_(kn)
                v_all[:, :, t : t + 1].copy_(vn)
                return grouped_sdpa(qd, k_all[:, :, : t + 1], v_all[:, :, : t + 1], scaling)

            variants[(f"static-{str(dtype).split('.')[-1]}", "in place + torch-sdpa")] = (static, lambda: None)
        times = {key: [] for key in variants}
        for call, reset in variants.values():
            call()
            reset()
        keys_ = list(variants)
        for r in range(args.rounds):
            for key in keys_[r % len(keys_):] + keys_[: r % len(keys_)]:
                call, reset = variants[key]
                settle = time.perf_counter() + args.settle_ms / 1e3  # see the docstring
                while time.perf_counter() < settle:
                    call()
                    reset()
                t0 = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - t0)
                reset()
        for (method, what), ts in times.items():
            rows.append({"context": tokens, "method": method, "step": what,
                         "median_ms": round(1e3 * statistics.median(ts), 3), "repeats": len(ts)})
            print(f"{tokens:>7} {method:>16} {what:>18} {rows[-1]['median_ms']:>10.3f} ms")
    return rows


def step_ratios(rows: list[dict]) -> dict:
    """Median dense step time (fp32, bf16) over each fused method's whole step, per context."""
    out = {}
    for ctx in sorted({r["context"] for r in rows}):
        at = {r["method"]: r["median_ms"] for r in rows if r["context"] == ctx}
        for method, ms in at.items():
            if not method.startswith(("dense", "static")):
                for dense in ("static-float32", "static-bfloat16", "dense-float32", "dense-bfloat16"):
                    out[f"{ctx}: {dense} step / fused {method} step"] = round(at[dense] / ms, 3)
    return out


# ---- end to end --------------------------------------------------------------------------------------
def greedy(model, ids: torch.Tensor, cache, new: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode tokens/s, tokens) of greedy decoding with `cache`."""
    with torch.no_grad():
        t0 = time.perf_counter()
        nxt = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        prefill = time.perf_counter() - t0
        tokens = [int(nxt)]
        t0 = time.perf_counter()
        for _ in range(new):
            nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
        return prefill, new / (time.perf_counter() - t0), tokens


def e2e_rows(args, recipe) -> list[dict]:
    from transformers import DynamicCache, StaticCache

    import kvsqueeze
    from kvsqueeze.eval.texts import load_text, token_windows
    from kvsqueeze.integrations.fused import enable_fused_decode
    from kvsqueeze.integrations.loading import load_model

    model, tok = load_model(args.model)
    trained = model.config.max_position_embeddings
    if args.prompt + args.new > trained:
        # a speed measurement past the model's trained context: RoPE turns further, the text it writes is not
        # the point, every cache computes the same attention over as many tokens
        model.config.max_position_embeddings = args.prompt + args.new + 1
    ids = token_windows(tok, load_text().evaluation, args.prompt, 1)
    shared, shared_s = None, None
    if args.e2e_prefill == "shared":
        from kvsqueeze.integrations.prefill import dense_prefill, filled_cache

        t0 = time.perf_counter()
        with torch.no_grad():
            shared = dense_prefill(model, ids[:, :-1])
        shared_s = time.perf_counter() - t0
        print(f"shared exact prefill of {ids.shape[1] - 1} tokens: {shared_s:.1f} s", flush=True)

    def filled(cache):  # a transformers cache holding the shared prefill's post-RoPE keys and values
        if shared is not None:
            b, t = shared.ids.shape
            for i, keys in enumerate(shared.post_keys):
                values = shared.values[i].view(b, t, keys.shape[1], keys.shape[3]).transpose(1, 2)
                cache.update(keys, values, i, {"cache_position": torch.arange(t)})
        return cache, None

    baselines = {"DynamicCache": lambda: filled(DynamicCache(config=model.config)),
                 "StaticCache": lambda: filled(StaticCache(config=model.config,
                                                           max_cache_len=args.prompt + args.new + 1))}
    wanted = [b for b in args.e2e_baselines.split(",") if b]
    if unknown := set(wanted) - set(baselines):
        raise SystemExit(f"--e2e-baselines: unknown {sorted(unknown)}; choose from {', '.join(baselines)}")
    runs = {name: baselines[name] for name in wanted}
    for method in args.e2e_methods.split(","):
        def ours(method=method):
            if shared is not None:
                cache = filled_cache(model, recipe, parse_method(method), shared)
            else:
                cache = kvsqueeze.cache_for(model, recipe, method)
            return cache, enable_fused_decode(model, cache)
        runs[f"kvsqueeze {method} (fused)"] = ours
    for bits in (int(b) for b in args.quantized_cache_bits.split(",") if b):
        def quantized(bits=bits):
            from transformers import QuantizedCache

            return filled(QuantizedCache(backend="quanto", config=model.config, nbits=bits))
        runs[f"QuantizedCache quanto int{bits}"] = quantized
    rows, reference = [], None
    for name, make in runs.items():
        try:
            cache, handle = make()
        except (ImportError, ValueError, RuntimeError) as exc:  # e.g. the quanto backend missing
            rows.append({"cache": name, "unavailable": f"{type(exc).__name__}: {exc}"})
            continue
        try:
            prefill, tps, tokens = greedy(model, ids if shared is None else ids[:, -1:], cache, args.new)
        finally:
            if handle is not None:
                handle.close()
        reference = tokens if name == "DynamicCache" else reference
        same = {} if reference is None else {
            "tokens_equal_to_dynamic_cache": f"{sum(a == b for a, b in zip(tokens, reference))}/{len(tokens)}"}
        rows.append({"cache": name, "prompt_tokens": args.prompt, "new_tokens": args.new, "trained_context": trained,
                     "decode_tokens_per_s": round(tps, 3), "tokens": tokens} | same
                    | ({"prefill_s": round(prefill, 2)} if shared is None else
                       {"prefill": f"shared exact prefill of {ids.shape[1] - 1} tokens, {shared_s:.1f} s"}))
        print({k: v for k, v in rows[-1].items() if k != "tokens"})
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.layers < 1 or args.rounds < 1:
        raise SystemExit(f"--layers and --rounds must be at least 1, got {args.layers} and {args.rounds}")
    if args.step and args.layers > 1:
        raise SystemExit("--step times one layer's cache (its append and reset keep one store warm): run it with "
                         "--layers 1")
    from kvsqueeze.methods import MethodError

    try:  # every name checked before any timing, so that a typo does not end a run after its kernel rows
        for name in (*args.methods.split(","), *(args.e2e_methods.split(",") if args.e2e else ())):
            parse_method(name)
        [int(b) for b in args.quantized_cache_bits.split(",") if b]
    except (MethodError, ValueError) as exc:
        raise SystemExit(f"decode.py: {exc}") from None
    recipe = prepare(args.threads, args.recipe)
    info = decode_machine()
    rows = kernel_rows(args, recipe)
    payload = {"rows": rows, "ratios": ratios(rows), "machine": info,
               "shape": dict(zip(("query_heads", "kv_heads", "head_dim"), shape(args, recipe)), batch=1),
               "quantizers": f"recipe {args.recipe} (middle layer)" if recipe else "synthetic, NormalFloat levels",
               "timing": f"median of {args.rounds} interleaved rounds, the order rotated each round "
                         f"(reference: {reference_rounds(args)} rounds after them)",
               "layers": args.layers,
               "dense_call": "SDPA with each KV head's query heads as its query rows (common.grouped_sdpa)",
               "commit": commit()}
    if args.step:
        payload["steps"] = step_rows(args, recipe)
        payload["step_ratios"] = step_ratios(payload["steps"])
        payload["settle_ms"] = args.settle_ms
        payload["step_timing"] = ("one layer's decode step: fused = store.append of the new token (quantize, pack, "
                                  "append) + decode_attention; static = the new key and value written in place "
                                  "into a cache allocated once (StaticCache, serving engines) + SDPA over it; dense = "
                                  "torch.cat of them onto the layer's cache (DynamicCache) + SDPA; a method with an "
                                  "fp16 window writes it and reads it; each variant restored to the same length after "
                                  f"each call, outside the timing; each timed call after {args.settle_ms:g} ms of "
                                  "untimed calls of the same variant")
    if args.e2e:
        payload["e2e"] = e2e_rows(args, recipe)
    payload["machine"]["load_average_end"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    for key, value in payload["ratios"].items():
        print(f"{key}: {value}x")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
