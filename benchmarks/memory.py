"""Bytes per token of real compressed KV caches on the default model, against fp16 and transformers' QuantizedCache.

For each KVQuant-style method a `kvsqueeze.cache_for` cache is filled with the
keys and values of one fp32 forward of `--tokens` tokens of BBC text (the
pre-RoPE `k_proj` and the `v_proj` outputs of every layer, captured once;
`--fill prefill` instead runs the prefill through the model per method, which
takes ~40 s per method on 2 CPU cores), and its bytes are read from
`memory_report()`: codes, scales, outliers, pointers, sinks, codebooks and
positions, everything counted. transformers' `QuantizedCache` (quanto backend,
its defaults: groups of 64, a 128-token residual window, emptied by a prefill)
is filled with the same post-RoPE K/V in fp16, as an fp16 model would hand it,
and measured from its quantized tensors. KIVI has no compressed storage here:
its row is `methods.storage_bits`, marked analytic.

    python benchmarks/memory.py --recipe out/recipe
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from kvsqueeze import cache_for
from kvsqueeze.config import DEFAULT_MODEL
from kvsqueeze.eval.texts import DEFAULT_TEXT, load_text, token_windows
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.integrations.parts import read_forward
from kvsqueeze.methods import parse_method, storage_bits
from kvsqueeze.recipe import Recipe
from kvsqueeze.shape import kv_shape

FP16_BYTES = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--recipe", required=True, help="recipe directory of --model")
    p.add_argument("--text", default=DEFAULT_TEXT, help="'bbc' (its evaluation part) or a text file")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--methods", default="fp16,nuq4-1%,nuq3-1%,nuq2-1%,nuq3", help="methods with a compressed cache")
    p.add_argument("--analytic", default="kivi2", help="methods reported from methods.storage_bits")
    p.add_argument("--quantized-cache-backend", default="quanto", help="transformers QuantizedCache backend")
    p.add_argument("--quantized-cache-bits", default="2,4", help="its bit widths ('' to skip)")
    p.add_argument("--fill", choices=("capture", "prefill"), default="capture")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "memory.json"))
    return p.parse_args(argv)


def capture_kv(model, ids: torch.Tensor) -> tuple[list, list, list, list]:
    """One forward: per layer the pre-RoPE keys and values [1, T, C] and post-RoPE K, V [1, H, T, D]."""
    reads, dyn = read_forward(model, ids)
    n = len(dyn.layers)
    return [reads[(i, "k")] for i in range(n)], [reads[(i, "v")] for i in range(n)], \
        [dyn.layers[i].keys for i in range(n)], [dyn.layers[i].values for i in range(n)]


def tensor_bytes(x) -> int:
    """Bytes of a tensor, of a quantized tensor subclass (its inner tensors) or of containers of them."""
    if isinstance(x, (tuple, list)):
        return sum(tensor_bytes(y) for y in x)
    if isinstance(x, dict):
        return sum(tensor_bytes(y) for y in x.values())
    if isinstance(x, torch.Tensor):
        if hasattr(x, "__tensor_flatten__") and type(x) is not torch.Tensor:
            names, _ = x.__tensor_flatten__()
            return sum(tensor_bytes(getattr(x, n)) for n in names)
        return x.numel() * x.element_size()
    return 0


def kvsqueeze_row(model, recipe, method: str, ids, kv, fill: str) -> dict:
    cache = cache_for(model, recipe, method)
    t0 = time.perf_counter()
    if fill == "prefill" or method == "fp16":
        if fill == "prefill":
            with torch.no_grad():
                model(ids, cache=cache, use_cache=True)
        else:
            for layer, k, v in zip(cache.layers, kv[2], kv[3]):
                layer.update(k, v)
    else:
        positions = torch.arange(ids.shape[1]).view(1, -1)
        for layer, k, v in zip(cache.layers, kv[0], kv[1]):
            layer.append_pre_rope(k, v, positions)
    rep = cache.memory_report()
    cache.close()
    return {
        "method": method, "bytes_per_token": round(rep.bytes_per_token, 2),
        "compression_vs_fp16": round(rep.compression, 3), "avg_bits": round(rep.avg_bits, 3),
        "total_bytes": rep.total_bytes, "capacity_bytes": rep.capacity_bytes, "components": rep.components,
        "source": "memory_report", "fill_seconds": round(time.perf_counter() - t0, 2),
    }


def quantized_cache_row(model, backend: str, bits: int, kv, tokens: int) -> dict:
    from transformers import QuantizedCache

    qc = QuantizedCache(backend=backend, config=model.config, nbits=bits)
    total = 0
    for layer, k, v in zip(qc.layers, kv[2], kv[3]):
        layer.update(k.half(), v.half())
        total += tensor_bytes([layer._quantized_keys, layer._quantized_values, layer.keys, layer.values])
    fp16 = sum(k.numel() + v.numel() for k, v in zip(kv[2], kv[3])) * FP16_BYTES
    return {
        "method": f"transformers-QuantizedCache-{backend}-int{bits}", "bytes_per_token": round(total / tokens, 2),
        "compression_vs_fp16": round(fp16 / total, 3), "avg_bits": round(8 * total / (fp16 / FP16_BYTES), 3),
        "total_bytes": total, "source": "bytes of its quantized tensors (q_group_size 64, residual_length 128)",
    }


def analytic_row(model, method: str, tokens: int) -> dict:
    shape = kv_shape(model.config)
    spec = parse_method(method)
    total = shape.layers * storage_bits(spec, tokens, shape.channels, head_dim=shape.head_dim)["total"] / 8
    fp16 = 2 * shape.layers * tokens * shape.channels * FP16_BYTES
    return {
        "method": f"{spec.name} (analytic)", "bytes_per_token": round(total / tokens, 2),
        "compression_vs_fp16": round(fp16 / total, 3), "avg_bits": round(8 * total / (fp16 / FP16_BYTES), 3),
        "total_bytes": round(total), "source": "methods.storage_bits (no KIVI storage is implemented)",
        "analytic": True,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    ids = token_windows(tok, load_text(args.text).evaluation, args.tokens, max_windows=1)  # [1, T]
    t0 = time.perf_counter()
    kv = capture_kv(model, ids)
    print(f"{args.model}: {args.tokens} tokens of {args.text}, one forward in {time.perf_counter() - t0:.1f}s")
    rows = [kvsqueeze_row(model, recipe, m.strip(), ids, kv, args.fill) for m in args.methods.split(",") if m.strip()]
    for bits in filter(None, args.quantized_cache_bits.split(",")):
        rows.append(quantized_cache_row(model, args.quantized_cache_backend, int(bits), kv, args.tokens))
    rows += [analytic_row(model, m.strip(), args.tokens) for m in args.analytic.split(",") if m.strip()]
    for r in rows:
        print(f"  {r['method']:<42} {r['bytes_per_token']:>9.1f} B/token  {r['compression_vs_fp16']:6.2f}x  "
              f"{r['avg_bits']:.2f} bits  ({r['source'].split(' (')[0]})")
    payload = {
        "model": args.model, "tokens": args.tokens, "text": args.text, "fill": args.fill,
        "machine": f"{platform.machine()} CPU, torch {torch.__version__}", "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
