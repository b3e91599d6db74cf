"""Stored bits of each method, as the compressed cache holds them, at 2K, 32K and 128K tokens.

For the default model, each method's `kvsqueeze.cache_for` cache is filled with the pre-RoPE keys and values of
one fp32 forward of BBC text (the `k_proj` and `v_proj` outputs of every layer, captured once; up to the model's
context, and beyond it the captured tokens again, appended through the layers' own `append_pre_rope` as a
prefill appends them, with positions running on), and its `memory_report()` is read: every component the cache
holds. Each measured row is first checked against the method registry's count (`methods.cache_bytes`) given
the outliers the stores kept, and a mismatch stops the run. Lengths past `--measure-up-to` are the registry's
count with nominal outlier counts (source "registry"). A 7B shape (Llama-2-7B: 32 layers, 32 KV heads of 128)
gets the registry's count for the plain methods; a bit budget's choice comes from a recipe of the model, and
no 7B recipe ships here. transformers' `QuantizedCache` (quanto backend) is measured from its quantized
tensors at the shortest length, filled with the same post-RoPE keys and values in fp16.

    python benchmarks/memory.py --recipe out/recipe

Writes {"model", "text", "machine", "rows": [{"model", "method", "tokens", "avg_bits", "bytes_per_token",
"compression_vs_fp16", "components", "source"}]}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze import cache_for, storage
from kvsqueeze.config import DEFAULT_MODEL
from kvsqueeze.eval.texts import DEFAULT_TEXT, load_text, token_windows
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.integrations.parts import read_forward
from kvsqueeze.methods import cache_bytes, parse_method
from kvsqueeze.recipe import Recipe
from kvsqueeze.shape import KVShape, kv_shape
from kvsqueeze.storage import Rows

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, tensor_bytes  # noqa: E402

HEADLINE = "nuq@3.49:r32:chan,nuq@2.6:r32:chan,nuq@4.58:r32:chan"
PLAIN = "fp16,nuq4-1%,nuq3-1%,nuq2-1%,kivi2"
SHAPE_7B = ("llama-2-7b", KVShape(layers=32, heads=32, kv_heads=32, head_dim=128))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--recipe", required=True, help="recipe directory of --model")
    p.add_argument("--text", default=DEFAULT_TEXT, help="'bbc' (its evaluation part) or a text file")
    p.add_argument("--methods", default=f"{PLAIN},{HEADLINE}")
    p.add_argument("--tokens", default="2048,32768,131072")
    p.add_argument("--measure-up-to", type=int, default=32768, help="longest length measured from a real cache")
    p.add_argument("--forward-tokens", type=int, default=8192, help="tokens of the one forward captured")
    p.add_argument("--quantized-cache-bits", default="2,4", help="transformers QuantizedCache widths ('' to skip)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    return p.parse_args(argv)


def row(model: str, method: str, tokens: int, components: dict, channels: int, layers: int, source: str) -> dict:
    total = storage.total(components)
    fp16 = 2 * 2 * tokens * channels * layers
    return {"model": model, "method": method, "tokens": tokens, "avg_bits": round(8 * total / (fp16 / 2), 4),
            "bytes_per_token": round(total / tokens, 2), "compression_vs_fp16": round(fp16 / total, 3),
            "components": {k: round(v) for k, v in components.items()}, "source": source}


def measured(model, recipe, method: str, keys: list, values: list, tokens: int) -> dict:
    """A real cache of `tokens` tokens filled with the captured keys and values (repeated past their length):
    its memory report, checked against the registry."""
    shape = kv_shape(model.config)
    spec = parse_method(method)
    cache = cache_for(model, recipe, spec)
    try:
        if not spec.quantized:  # the fp16 cache holds post-RoPE keys; their bytes do not depend on the values
            c = shape.channels
            for layer in cache.layers:
                for start in range(0, tokens, keys[0].shape[1]):
                    n = min(keys[0].shape[1], tokens - start)
                    x = torch.zeros(1, shape.kv_heads, n, shape.head_dim)
                    layer.update(x, x)
            assert all(layer.kept_tokens() * 2 * 2 * c == layer.component_bytes()["codes"] for layer in cache.layers)
        else:
            done = 0
            while done < tokens:
                n = min(keys[0].shape[1], tokens - done)
                positions = torch.arange(done, done + n).view(1, -1)
                for layer, k, v in zip(cache.layers, keys, values):
                    layer.append_pre_rope(k[:, :n], v[:, :n], positions)
                done += n
        report = cache.memory_report()
        held, outliers = [], []
        for layer in cache.layers:
            held.append(None if layer.window is None else layer.kept_tokens())
            s = getattr(layer, "store", None)
            if s is None:
                outliers.append((None, None))
                continue
            n_sinks = int(s.sink_count.sum())
            outliers.append((s.k_outliers.nnz if s.k_outliers is not None else 0,
                             s.v_outliers.nnz - n_sinks * (s.v_fixed or 0) if s.v_outliers is not None else 0))
        want = cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, Rows(tokens), recipe, held, outliers)
        if want != report.components:
            raise SystemExit(f"{method} at {tokens} tokens: the memory report {report.components} differs from the "
                             f"registry's count {want}")
        return report.components
    finally:
        cache.close()


def quantized_cache_row(model, name: str, bits: int, post_k: list, post_v: list, tokens: int) -> dict:
    from transformers import QuantizedCache

    qc = QuantizedCache(backend="quanto", config=model.config, nbits=bits)
    total = 0
    for layer, k, v in zip(qc.layers, post_k, post_v):
        layer.update(k[:, :, :tokens].half(), v[:, :, :tokens].half())
        total += tensor_bytes([layer._quantized_keys, layer._quantized_values, layer.keys, layer.values])
    shape = kv_shape(model.config)
    r = row(name, f"transformers-QuantizedCache-quanto-int{bits}", tokens, {"codes": total}, shape.channels,
            shape.layers, "bytes of its quantized tensors (q_group_size 64, residual_length 128)")
    r["components"] = {}
    return r


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    shape = kv_shape(model.config)
    lengths = [int(t) for t in args.tokens.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    ids = token_windows(tok, load_text(args.text).evaluation, args.forward_tokens, max_windows=1)  # [1, T]
    t0 = time.perf_counter()
    reads, dyn = read_forward(model, ids)
    keys = [reads[(i, "k")] for i in range(shape.layers)]
    values = [reads[(i, "v")] for i in range(shape.layers)]
    print(f"{args.model}: one forward of {ids.shape[1]} tokens of {args.text} in {time.perf_counter() - t0:.1f}s")
    rows = []
    for method in methods:
        spec = parse_method(method)
        for t in lengths:
            if t <= args.measure_up_to and (not spec.quantized or _cached(spec)):
                comps, source = measured(model, recipe, method, keys, values, t), "memory_report"
            else:
                comps = cache_bytes(spec, shape.layers, shape.channels, shape.head_dim, Rows(t), recipe)
                source = "registry" if _cached(spec) or not spec.quantized else "registry (no compressed cache)"
            rows.append(row(args.model, spec.name, t, comps, shape.channels, shape.layers, source))
            print(f"  {args.model:<14} {spec.name:<22} {t:>7}  {rows[-1]['avg_bits']:7.3f} bits  ({source})")
    name, big = SHAPE_7B
    for method in methods:
        spec = parse_method(method)
        if spec.budget is not None:
            continue  # its choice comes from a recipe of that model
        for t in lengths:
            comps = cache_bytes(spec, big.layers, big.channels, big.head_dim, Rows(t))
            rows.append(row(name, spec.name, t, comps, big.channels, big.layers, "registry"))
            print(f"  {name:<14} {spec.name:<22} {t:>7}  {rows[-1]['avg_bits']:7.3f} bits  (registry)")
    post_k = [dyn.layers[i].keys for i in range(shape.layers)]
    post_v = [dyn.layers[i].values for i in range(shape.layers)]
    for bits in filter(None, args.quantized_cache_bits.split(",")):
        try:
            import optimum.quanto  # noqa: F401  (QuantizedCache's backend, not a kvsqueeze dependency)
        except ImportError:
            print("  QuantizedCache rows skipped: pip install optimum-quanto to measure them")
            break
        rows.append(quantized_cache_row(model, args.model, int(bits), post_k, post_v, min(lengths[0], ids.shape[1])))
    payload = {"model": args.model, "text": args.text, "forward_tokens": int(ids.shape[1]), "machine": machine(),
               "protocol": "measured rows: a real cache filled with one forward's keys and values (repeated past "
                           "them), its memory report equal to the registry's count; registry rows: nominal outliers",
               "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


def _cached(spec) -> bool:
    from kvsqueeze.methods import family

    return family(spec).why_not(spec, "cache") is None


if __name__ == "__main__":
    main()
