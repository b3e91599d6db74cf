"""Every KV-cache quantizer a user could pick, on the same token windows, with the same columns.

    python benchmarks/peers.py --recipe out/recipe [--model smollm2-135m] [--text bbc] [--seqlen 2048]
        [--windows 8] [--json benchmarks/results/peers.json]

Rows: our methods (nuq2/3/4-1%, KIVI-2/4, TurboQuant 2.5 / 3.5 bits as `turbo2:split` / `turbo3:split`,
simulated as the cache would hold them), transformers' `QuantizedCache` with optimum-quanto (int2, int4) and
HQQ (2, 3, 4 bits), and llama.cpp's KV cache types through llama-cpp-python where it is installed (an
optional extra that builds from source). Each row: PPL, its change against the fp16 row of the same engine
with a paired 95% interval over the windows, the mean and 99th-percentile KL divergence per token from that
fp16 distribution, top-1 agreement, and the bits per K/V element the cache holds.

How each peer is fed: `QuantizedCache` quantizes in one shot whatever reaches it and keeps `residual_length`
(128) recent tokens exact, flushing them all into the quantized part when they fill up; feeding a window in
chunks of exactly that length reproduces token-by-token decoding (every flush happens at the same token,
every query sees the same exact and quantized tokens), at the cost of one forward per chunk. Its bits are
what it holds in a 16-bit model (codes, an fp16 scale and zero-point per group of 64, the exact residual
left at the end of a window); the bytes it held in this float32 run, where its scales and residual are
float32, are recorded beside them. llama.cpp computes with the GGUF's quantized weights, so its rows
compare with llama.cpp's own f16 cache, not with ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.eval.perplexity import against_reference, evaluate, row_from_windows, window_logits
from kvsqueeze.eval.texts import evaluation_windows, load_text
from kvsqueeze.integrations.loading import load_model
from kvsqueeze.integrations.simulate import SimulatedQuantization
from kvsqueeze.methods import parse_method
from kvsqueeze.recipe import Recipe
from kvsqueeze.shape import kv_shape

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, peers_table, tensor_bytes  # noqa: E402

OURS = ["fp16", "kivi2", "kivi4", "turbo2:split", "turbo3:split", "nuq4-1%", "nuq3-1%", "nuq2-1%"]
QUANTIZED_CACHE = [("quanto", 2), ("quanto", 4), ("hqq", 2), ("hqq", 3), ("hqq", 4)]
RESIDUAL = 128  # QuantizedCache's residual_length (its default)
GROUP = 64  # its q_group_size (its default)


@torch.no_grad()
def quantized_cache_logits(model, ids: torch.Tensor, backend: str, bits: int) -> tuple[torch.Tensor, float]:
    """Next-token log-probabilities [T-1, V] of ids [1, T] through a QuantizedCache fed RESIDUAL tokens a
    forward, and the bits per K/V element it holds at the end."""
    from transformers import QuantizedCache

    cache = QuantizedCache(backend=backend, config=model.config, nbits=bits, residual_length=RESIDUAL)
    outs = []
    for s in range(0, ids.shape[1], RESIDUAL):
        outs.append(model(ids[:, s : s + RESIDUAL], cache=cache, use_cache=True).logits.float())
    logits = torch.cat(outs, dim=1)[0, :-1]
    held = sum(tensor_bytes([layer._quantized_keys, layer._quantized_values, layer.keys, layer.values])
               for layer in cache.layers)
    shape = kv_shape(model.config)
    return logits.log_softmax(-1), 8 * held / (2 * shape.layers * ids.shape[1] * shape.channels)


def quantized_cache_bits(bits: int, tokens: int) -> float:
    """What QuantizedCache holds per K/V element in a 16-bit model: the codes, an fp16 scale and zero-point per
    group of GROUP elements, and the exact residual tokens left at the end (tokens % RESIDUAL, 16 bits)."""
    residual = tokens % RESIDUAL
    return ((tokens - residual) * (bits + 32 / GROUP) + residual * 16) / tokens


LLAMA_CPP_TYPES = [  # (method, K type, V type, bits per K/V element: 32-element blocks with one fp16 scale)
    ("fp16", "F16", "F16", 16.0),
    ("q8_0", "Q8_0", "Q8_0", 8.5),
    ("q4_0", "Q4_0", "Q4_0", 4.5),
    ("k-q8_0/v-q4_0", "Q8_0", "Q4_0", 6.5),
]


def llama_cpp_rows(model_name: str, windows: torch.Tensor) -> list[dict] | str:
    """llama.cpp's KV cache types on the same token windows, each against llama.cpp's own f16 cache, or why
    there are none.

    The windows' token ids go to llama.cpp as they are (the GGUF holds the same vocabulary the HF tokenizer was
    built from), one window per fresh context, all logits kept; flash attention is on, which llama.cpp needs
    for a quantized V cache, for every type including f16."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (`pip install llama-cpp-python==0.3.36`, which builds from "
                "source in about 12 minutes): no llama.cpp rows")
    import tempfile

    import llama_cpp

    from kvsqueeze.integrations.loading import BUNDLED, _bundled_gguf

    if model_name.lower() not in BUNDLED:
        return f"llama.cpp rows need one of the bundled GGUF models ({', '.join(BUNDLED)}), not {model_name!r}"
    seqlen = windows.shape[1]
    rows, refs, base_nll = [], {}, None
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _bundled_gguf(model_name.lower(), Path(tmp))
        for method, k_type, v_type, bits in LLAMA_CPP_TYPES:
            llm = llama_cpp.Llama(
                model_path=str(gguf), n_ctx=seqlen, n_batch=512, n_ubatch=512, logits_all=True,
                n_threads=torch.get_num_threads(), flash_attn=True, verbose=False, seed=0,
                type_k=getattr(llama_cpp, f"GGML_TYPE_{k_type}"), type_v=getattr(llama_cpp, f"GGML_TYPE_{v_type}"))
            nll, tokens, klds, top1 = [], [], [], 0
            for i, w in enumerate(windows):
                llm.reset()  # the next eval drops every cached token past n_tokens = 0
                llm.eval(w.tolist())
                logits = torch.from_numpy(llm.scores[: seqlen - 1].copy()).float()
                logp = logits.log_softmax(-1)
                if not torch.isfinite(logp).all():
                    raise FloatingPointError(f"llama.cpp {method} produced NaN/Inf logits on window {i}")
                if method == "fp16":
                    refs[i] = logp
                ref = refs[i]
                target = w[1:]
                n, k, t1 = against_reference(ref, ref.argmax(-1), logp, target)
                nll.append(n)
                tokens.append(int(target.numel()))
                klds.append(k)
                top1 += t1
                print(f"llama.cpp {method}: window {i + 1} of {windows.shape[0]}", flush=True)
            row = row_from_windows(method, bits, nll, tokens, klds, top1, base_nll)
            if method == "fp16":
                base_nll = nll
            engine = f"llama.cpp {llama_cpp.__version__} (GGUF weights, flash attention)"
            rows.append({**row.as_dict(), "engine": engine, "cache_types": {"k": k_type.lower(), "v": v_type.lower()}})
            del llm
    return rows


def measure_hf_rows(model, ew, recipe: Recipe, seqlen: int) -> tuple[list[dict], dict[str, str]]:
    """Our rows and QuantizedCache's, and what could not be measured and why."""
    ours = evaluate(model, ew.ids, [parse_method(m) for m in OURS], recipe)
    rows = [{**r.as_dict(), "engine": "kvsqueeze (simulated)"} for r in ours]
    base_nll = list(ours[0].window_nll)  # fp16, the first of OURS
    refs: dict[int, torch.Tensor] = {}  # window -> fp16 log-probabilities, computed once
    missing = {}
    for backend, bits in QUANTIZED_CACHE:
        name = f"{backend.lower()}-int{bits}"
        need = "optimum.quanto" if backend == "quanto" else "hqq"
        if importlib.util.find_spec(need.split(".")[0]) is None:
            missing[name] = f"{need} is not installed"
            continue
        nll, tokens, klds, top1, bits_held = [], [], [], 0, []
        for i, w in enumerate(ew.ids):
            ids = w.view(1, -1)
            if i not in refs:
                with SimulatedQuantization(model, parse_method("fp16"), None) as sim:
                    refs[i] = window_logits(model, ids, sim)[0]
            ref = refs[i]
            logp, held = quantized_cache_logits(model, ids, backend, bits)
            target = ids[0, 1:]
            n, k, t1 = against_reference(ref, ref.argmax(-1), logp, target)
            nll.append(n)
            tokens.append(int(target.numel()))
            klds.append(k)
            top1 += t1
            bits_held.append(held)
            print(f"{name}: window {len(nll)} of {ew.ids.shape[0]}", flush=True)
        row = row_from_windows(name, quantized_cache_bits(bits, seqlen), nll, tokens, klds, top1, base_nll)
        rows.append({**row.as_dict(), "engine": f"transformers QuantizedCache ({backend}, residual {RESIDUAL})",
                     "bits_held_in_this_float32_run": round(sum(bits_held) / len(bits_held), 3)})
    return rows, missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/peers.json")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the kvsqueeze and QuantizedCache rows of an existing --json measured on the same "
                         "windows with the same recipe, and measure only the llama.cpp rows")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = load_model(args.model)
    recipe = Recipe.load(args.recipe)
    ew = evaluation_windows(tok, load_text(args.text), args.seqlen, args.windows)
    t0 = time.perf_counter()
    previous = json.loads(Path(args.json).read_text()) if args.reuse and Path(args.json).exists() else None
    if previous is not None:
        same = (previous["seqlen"] == args.seqlen and previous["window_sources"] == ew.describe()
                and previous["recipe"] == recipe.meta.get("settings") and previous["model"] == args.model)
        if not same:
            raise SystemExit(f"--reuse: {args.json} was measured on other windows, model or recipe; run without it")
        rows = [r for r in previous["rows"] if not r["engine"].startswith("llama.cpp")]
        missing = {k: v for k, v in previous["not_measured"].items() if k != "llama.cpp"}
        reused = {"rows_from": previous.get("measured_on", "an earlier run"), "seconds": previous["seconds"]}
    else:
        rows, missing = measure_hf_rows(model, ew, recipe, args.seqlen)
        reused = None
    llama = llama_cpp_rows(args.model, ew.ids)
    if isinstance(llama, str):
        missing["llama.cpp"] = llama
    else:
        rows += llama
    payload = {
        "model": args.model, "text": f"{args.text} (evaluation part)", "seqlen": args.seqlen,
        "windows": int(ew.ids.shape[0]), "window_sources": ew.describe(),
        "machine": machine(),
        "recipe": recipe.meta.get("settings"), "seconds": round(time.perf_counter() - t0, 1),
        "measured_on": time.strftime("%Y-%m-%d"), **({"reused": reused} if reused else {}),
        "not_measured": missing, "rows": rows,
    }
    Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    print(peers_table(payload))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
