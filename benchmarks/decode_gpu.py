"""Decode speed on a GPU: the Triton kernels over the compressed cache against bf16 SDPA, and generate().

    python benchmarks/decode_gpu.py [--contexts 8192,32768,131072] [--batches 1,8]
        [--json benchmarks/results/decode_gpu.json]

Kernel rows, for two layer shapes (a 7B-class layer: 32 query heads over 8 KV heads of width 128; the
default model's: 9 over 3 of width 64), each context length and batch:

* `attention`: one decode step of attention (one query token per row), `kvsqueeze.kernels.decode_attention`
  with the triton backend over a compressed store's view, for nuq4-1% / nuq3-1% / nuq2-1%, against
  `torch.nn.functional.scaled_dot_product_attention` (`enable_gqa=True`) over bfloat16 K and V;
* `step`: what a layer's decode step costs a user: append the new token (quantize, pack, append) and attend,
  against a `DynamicCache` layer's step in bfloat16 (concatenate the new key and value, then SDPA).

Before anything is timed, the Triton result is checked against the reference backend on the very store it is
timed on. Times are wall-clock, the device synchronized before and after each call (what a caller waits for,
launches and the one host read of the positions' range included); variants alternate round by round in a
rotating order, medians reported.

The stores hold synthetic heavy-tailed keys and values (Student t, 5 degrees of freedom) inside per-channel
ranges of a synthetic quantizer with the method's bits and outlier fraction (NormalFloat levels instead of a
recipe's codebook: the bytes read and the work done are the same, the values of the levels do not matter to
speed), so about 1% of the elements are outliers as in real caches.

`--e2e` (default on): greedy decoding after a `--e2e-context`-token prompt, decode tokens/s of `generate()`'s
loop (prefill timed apart) with the compressed cache and fused decode against `DynamicCache`, bfloat16 model.
The model is the default one when it is installed (with `--recipe`); otherwise its architecture
(SmolLM2-135M's config, below) with random weights, calibrated on the spot on random tokens: speed does not
depend on the weights, and the JSON says which it was.

Runs in under 8 minutes on one H200 (a GPU machine needs transformers 5.24 beside its own torch and triton).
With `--device cpu` under `TRITON_INTERPRET=1` it runs, slowly, on tiny sizes: the tests use that to keep
this script working on machines without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvsqueeze.cache.positions import PositionLog
from kvsqueeze.cache.store import KVStore
from kvsqueeze.numerics.datatypes import normal_float_levels
from kvsqueeze.kernels import Rope, decode_attention
from kvsqueeze.methods import parse_method
from kvsqueeze.numerics.quantizer import VectorQuantizer

TAIL_DF = 5.0  # Student-t degrees of freedom of the synthetic activations
TAIL_Q99 = 4.032  # |t_5| exceeds this with probability 1%: scaled by it, 1% of a channel leaves its range
SHAPES = {"7b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # query heads, KV heads, head_dim
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="8192,32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--shapes", default="7b,smollm2-135m", help=f"of {', '.join(SHAPES)}")
    p.add_argument("--methods", default="nuq4-1%,nuq3-1%,nuq2-1%")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--no-e2e", dest="e2e", action="store_false")
    p.add_argument("--e2e-context", type=int, default=32768)
    p.add_argument("--e2e-new", type=int, default=64)
    p.add_argument("--e2e-method", default="nuq3-1%")
    p.add_argument("--e2e-layers", type=int, help="layers of the random-weight model (default: SmolLM2-135M's 30)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--random-model", action="store_true", help="use the random-weight model even if --model loads")
    p.add_argument("--recipe", default="out/recipe")
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help="skip the per-kernel GPU time of a 7B-class layer's step (torch's profiler)")
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "decode_gpu.json"))
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "platform": platform.platform(),
            "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1"}
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        info |= {"gpu": prop.name, "multiprocessors": prop.multi_processor_count,
                 "memory_gib": round(prop.total_memory / 2**30, 1)}
    return info


def quantizers(method: str, channels: int, device: torch.device, seed: int) -> tuple[VectorQuantizer, ...]:
    spec = parse_method(method)
    g = torch.Generator().manual_seed(seed)
    center, half = torch.randn(channels, generator=g) * 2, torch.rand(channels, generator=g) * 3 + 0.5
    kq = VectorQuantizer(normal_float_levels(spec.k_bits), "channel", spec.outlier_fraction,
                         lo=(center - half).to(device), hi=(center + half).to(device))
    return kq, VectorQuantizer(normal_float_levels(spec.v_bits), "token", spec.outlier_fraction)


def fill_store(method: str, batch: int, tokens: int, channels: int, head_dim: int, device: torch.device,
               seed: int, chunk: int = 4096) -> KVStore:
    kq, vq = quantizers(method, channels, device, seed)
    center, half = (kq.hi + kq.lo) / 2, (kq.hi - kq.lo) / 2
    tdist = torch.distributions.StudentT(torch.tensor(TAIL_DF, device=device))
    store = KVStore(kq, vq, channels, parse_method(method).sinks, device, head_dim=head_dim,
                    positions=PositionLog(device))
    torch.manual_seed(seed)
    spread = 0.5 + torch.rand(channels, device=device)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        keys = center + half * tdist.sample((batch, n, channels)) / TAIL_Q99
        store.append(keys, tdist.sample((batch, n, channels)) * spread)
    return store


def check(q, store: KVStore, rope: Rope, scaling: float, what: str) -> float:
    """The Triton result against the reference on the store it is timed on (exits on a mismatch)."""
    got = decode_attention(q, store.view(), rope, scaling, backend="triton")
    want = decode_attention(q, store.view(), rope, scaling, backend="reference")
    err = float((got - want).abs().max())
    if not torch.allclose(got, want, atol=5e-5, rtol=1e-4):
        raise SystemExit(f"{what}: the triton backend differs from the reference by {err:.3g}")
    return err


def timed(variants: dict, rounds: int, device: torch.device) -> dict:
    """Median and min wall ms of every variant (call, reset), rounds interleaved in a rotating order."""
    for call, reset in variants.values():
        call()
        reset()
    keys = list(variants)
    times = {k: [] for k in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            call, reset = variants[key]
            sync(device)
            t0 = time.perf_counter()
            call()
            sync(device)
            times[key].append(time.perf_counter() - t0)
            reset()
    return {k: (1e3 * statistics.median(v), 1e3 * min(v)) for k, v in times.items()}


def kernel_rows(args, device: torch.device) -> list[dict]:
    rows = []
    for shape_name, batch, tokens in itertools.product(args.shapes.split(","), map(int, args.batches.split(",")),
                                                        map(int, args.contexts.split(","))):
        hq, h, d = SHAPES[shape_name]
        c = h * d
        rope, scaling = Rope.default(d, theta=500_000.0), d**-0.5
        g = torch.Generator(device=device).manual_seed(tokens)
        q = torch.randn(batch, hq, d, device=device, generator=g)
        k1 = torch.randn(batch, 1, c, device=device, generator=g)
        v1 = torch.randn(batch, 1, c, device=device, generator=g)
        pos = torch.full((batch, 1), tokens - 1, device=device)
        variants, errors = {}, {}
        for i, method in enumerate(args.methods.split(",")):
            store = fill_store(method, batch, tokens - 1, c, d, device, seed=i)
            store.append(k1, v1, None, pos)
            errors[method] = check(q, store, rope, scaling, f"{method}, {shape_name}, B={batch}, T={tokens}")
            variants[(method, "attention")] = (
                lambda store=store: decode_attention(q, store.view(), rope, scaling, backend="triton"), lambda: None)

            def step(store=store):
                store.append(k1, v1, None, pos)
                return decode_attention(q, store.view(), rope, scaling, backend="triton")

            store.crop(tokens - 1)
            variants[(method, "step")] = (step, lambda store=store: store.crop(tokens - 1))
        keys = torch.randn(batch, h, tokens - 1, d, device=device, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        qd = q.view(batch, hq, 1, d).bfloat16()
        kn, vn = k1.view(batch, 1, h, d).transpose(1, 2).bfloat16(), v1.view(batch, 1, h, d).transpose(1, 2).bfloat16()
        full_k, full_v = torch.cat([keys, kn], dim=-2), torch.cat([values, vn], dim=-2)

        def sdpa(k=full_k, v=full_v):
            return F.scaled_dot_product_attention(qd, k, v, scale=scaling, enable_gqa=True)

        def dense_step():  # DynamicLayer.update (torch.cat) + SDPA
            k, v = torch.cat([keys, kn], dim=-2), torch.cat([values, vn], dim=-2)
            return F.scaled_dot_product_attention(qd, k, v, scale=scaling, enable_gqa=True)

        # what StaticCache and serving engines do: the new token written in place into a cache allocated once
        k_all, v_all = full_k.clone(), full_v.clone()

        def static_step(t=tokens - 1):
            k_all[:, :, t : t + 1].copy_(kn)
            v_all[:, :, t : t + 1].copy_(vn)
            return F.scaled_dot_product_attention(qd, k_all[:, :, : t + 1], v_all[:, :, : t + 1], scale=scaling,
                                                  enable_gqa=True)

        variants[("dense-bfloat16", "attention")] = (sdpa, lambda: None)
        variants[("dense-bfloat16", "step")] = (dense_step, lambda: None)
        variants[("static-bfloat16", "step")] = (static_step, lambda: None)
        for (method, what), (med, low) in timed(variants, args.rounds, device).items():
            rows.append({"shape": shape_name, "query_heads": hq, "kv_heads": h, "head_dim": d, "batch": batch,
                         "context": tokens, "method": method, "what": what, "median_ms": round(med, 4),
                         "min_ms": round(low, 4), "max_abs_error_vs_reference": errors.get(method)})
            print(f"{shape_name:>13} B={batch} T={tokens:>7} {method:>15} {what:>9} {med:9.4f} ms", flush=True)
        variants = keys = values = full_k = full_v = k_all = v_all = None  # free the caches before the next shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def profile(args, device: torch.device) -> list[dict]:
    """GPU time of each kernel in a layer's decode step (append, then attend), from torch's profiler, for the
    7B-class shape at B=8 and 32K tokens, with and without the outlier fraction: where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    hq, h, d = SHAPES["7b"]
    batch, tokens, steps = 8, 32768, 5
    rope, scaling = Rope.default(d, theta=500_000.0), d**-0.5
    q = torch.randn(batch, hq, d, device=device)
    k1, v1 = torch.randn(batch, 1, h * d, device=device), torch.randn(batch, 1, h * d, device=device)
    pos = torch.full((batch, 1), tokens - 1, device=device)
    out = []
    for i, method in enumerate(("nuq3-1%", "nuq3")):
        store = fill_store(method, batch, tokens - 1, h * d, d, device, seed=i)
        for _ in range(2):  # compiled and checked before the profile
            store.append(k1, v1, None, pos)
            decode_attention(q, store.view(), rope, scaling, backend="triton")
            store.crop(tokens - 1)
        sync(device)
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                store.append(k1, v1, None, pos)
                decode_attention(q, store.view(), rope, scaling, backend="triton")
                store.crop(tokens - 1)
            sync(device)
        kernels = sorted(((e.key, e.device_time_total / steps / 1e3, e.count // steps) for e in prof.key_averages()
                          if e.device_time_total > 0), key=lambda x: -x[1])
        total = sum(ms for _, ms, _ in kernels)
        out.append({"shape": "7b", "batch": batch, "context": tokens, "method": method,
                    "gpu_ms_per_step": round(total, 4), "kernels_per_step": sum(n for *_, n in kernels),
                    "by_kernel": [{"kernel": k[:80], "ms": round(ms, 4), "calls": n} for k, ms, n in kernels[:12]]})
        print(f"profile {method}: {total:.3f} GPU ms a step; " + ", ".join(f"{k[:30]} {ms:.3f}" for k, ms, _ in
                                                                          kernels[:6]), flush=True)
        del store
    return out


def ratios(rows: list[dict]) -> dict:
    """The bf16 baselines' times over each method's, per shape, batch, context and what was timed: SDPA alone
    against attention, and both the concatenating and the in-place dense step against the step."""
    out = {}
    at = {(r["shape"], r["batch"], r["context"], r["what"], r["method"]): r["median_ms"] for r in rows}
    for (shape, b, t, what, method), ms in at.items():
        if method in ("dense-bfloat16", "static-bfloat16"):
            continue
        for base in ("dense-bfloat16", "static-bfloat16"):
            if (shape, b, t, what, base) in at:
                out[f"{shape} B={b} T={t} {what}: {base} / {method}"] = float(f"{at[(shape, b, t, what, base)] / ms:.4g}")
    return out


def e2e(args, device: torch.device) -> dict:
    """Greedy decode tokens/s after a long prompt: compressed cache + fused decode against DynamicCache."""
    from transformers import DynamicCache, StaticCache

    import kvsqueeze
    from kvsqueeze.integrations.fused import enable_fused_decode

    model, recipe, about = _e2e_model(args, device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, args.e2e_context), generator=g).to(device)
    runs = {"DynamicCache (bf16)": lambda: (DynamicCache(config=model.config), None),
            "StaticCache (bf16)": lambda: (StaticCache(config=model.config,
                                                        max_cache_len=args.e2e_context + args.e2e_new + 1), None)}

    def ours():
        cache = kvsqueeze.cache_for(model, recipe, args.e2e_method)
        return cache, enable_fused_decode(model, cache, "triton")

    runs[f"kvsqueeze {args.e2e_method} (fused, triton)"] = ours
    rows, first, waits = [], None, {}
    for name, make in runs.items():
        cache, handle = make()
        try:
            with torch.no_grad():
                sync(device)
                t0 = time.perf_counter()
                nxt = model(ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                sync(device)
                prefill = time.perf_counter() - t0
                if device.type == "cuda" and not isinstance(cache, StaticCache):  # it writes by position, in place
                    waits[name] = host_waits(model, cache, nxt)
                tokens = [int(nxt)]
                t0 = time.perf_counter()
                for _ in range(args.e2e_new):
                    nxt = model(nxt, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    tokens.append(int(nxt))  # the host reads every token, as generate() does
                sync(device)
                tps = args.e2e_new / (time.perf_counter() - t0)
        finally:
            if handle is not None:
                handle.close()
        first = first or tokens
        rows.append({"cache": name, "prompt_tokens": args.e2e_context, "new_tokens": args.e2e_new,
                     "prefill_s": round(prefill, 3), "decode_tokens_per_s": round(tps, 2),
                     "tokens_equal_to_dynamic_cache": f"{sum(a == b for a, b in zip(tokens, first))}/{len(tokens)}"})
        print(rows[-1], flush=True)
        del cache
    ours_tps = rows[-1]["decode_tokens_per_s"]
    return {"model": about, "layers": model.config.num_hidden_layers, "rows": rows,
            "speedup_vs_dynamic_cache": round(ours_tps / rows[0]["decode_tokens_per_s"], 3),
            "speedup_vs_static_cache": round(ours_tps / rows[1]["decode_tokens_per_s"], 3),
            "host_waits_in_one_decode_step": waits}


def host_waits(model, cache, token) -> dict:
    """The ops of one decode step (all layers) that make the host wait for the GPU, counted by CUDA's own sync
    check (`torch.cuda.set_sync_debug_mode`), by the line of kvsqueeze's code that called them. The step counted
    is the second after the prefill (the first builds tables that later steps reuse); both steps' tokens are
    taken back (`cache.crop`), so that the timed decoding starts from the prefill as before."""
    import traceback
    import warnings

    length = cache.get_seq_length()
    model(token, cache=cache, use_cache=True)  # a first step builds what later steps reuse (RoPE tables, ...)
    cache.crop(length - cache.get_seq_length())
    counts: dict[str, int] = {}

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        ours = [f for f in traceback.extract_stack() if "/kvsqueeze/" in f.filename]
        where = (f"{ours[-1].filename.split('/kvsqueeze/')[-1]}:{ours[-1].name}" if ours
                 else f"{Path(filename).name}:{lineno}")
        counts[where] = counts.get(where, 0) + 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            model(token, cache=cache, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    cache.crop(length - cache.get_seq_length())  # a negative count: the tokens to take back
    print(f"host waits in one decode step: {counts}", flush=True)
    return {"total": sum(counts.values()), "by_line": counts}


def _e2e_model(args, device: torch.device):
    from kvsqueeze.integrations.loading import ModelLoadError, load_model
    from kvsqueeze.recipe import Recipe

    reason = "--random-model"
    if not args.random_model:
        try:
            model, _ = load_model(args.model, "bfloat16", device)
            return model, Recipe.load(args.recipe), f"{args.model} with the recipe {args.recipe}"
        except (ModelLoadError, FileNotFoundError, OSError) as exc:
            reason = f"{args.model} could not be loaded: {type(exc).__name__}: {exc}"
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvsqueeze.calibrate.collect import collect
    from kvsqueeze.calibrate.fit import fit_recipe
    from kvsqueeze.config import CalibrationConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": args.e2e_layers or SMOLLM2_135M["num_hidden_layers"]})
    cfg.max_position_embeddings = max(cfg.max_position_embeddings, args.e2e_context + args.e2e_new + 1)
    model = LlamaForCausalLM(cfg).to(device).eval()  # float32 to calibrate, bfloat16 to decode
    cal = CalibrationConfig(samples=2, seqlen=512, bits=(parse_method(args.e2e_method).k_bits,),
                            fractions=(0.0, parse_method(args.e2e_method).outlier_fraction))
    samples = torch.randint(3, cfg.vocab_size, (cal.samples, cal.seqlen), generator=torch.Generator().manual_seed(1))
    recipe = fit_recipe(model, collect(model, samples.to(device), sinks=cal.sinks, progress=False), cal,
                        "random-smollm2-135m", "random tokens", progress=False)
    return model.bfloat16(), recipe, (f"SmolLM2-135M's architecture ({cfg.num_hidden_layers} layers) with random "
                                      f"weights, calibrated on random tokens ({reason}); its next-token "
                                      "distributions are nearly flat, so tokens_equal says nothing there")


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: this benchmark measures the GPU path (pass --device cpu under "
                         "TRITON_INTERPRET=1 only to check that it runs)")
    t0 = time.perf_counter()
    payload = {"machine": machine(device), "methods": args.methods.split(","),
               "quantizers": "synthetic, NormalFloat levels, per-channel key ranges, the methods' outlier fractions",
               "timing": f"wall-clock ms, device synchronized around each call, median of {args.rounds} "
                         "interleaved rounds in a rotating order",
               "dense": "torch.nn.functional.scaled_dot_product_attention(enable_gqa=True) over bfloat16 K/V; "
                        "its step adds DynamicLayer's torch.cat of the new token"}
    payload["rows"] = kernel_rows(args, device)
    payload["ratios"] = ratios(payload["rows"])
    if args.profile and device.type == "cuda":
        payload["profile"] = profile(args, device)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")  # the kernel rows, whatever follows
    if args.e2e:
        try:
            payload["e2e"] = e2e(args, device)
        except Exception as exc:  # noqa: BLE001 - the kernel rows are kept; the JSON says why this part is missing
            payload["e2e_error"] = f"{type(exc).__name__}: {exc}"
            print(f"generate() part not measured: {payload['e2e_error']}", flush=True)
    payload["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    for key, value in payload["ratios"].items():
        print(f"{key}: {value}x")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
