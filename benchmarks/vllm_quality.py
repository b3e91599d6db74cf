"""Quality through vLLM's engine: the served method's perplexity beside the HF path's, on the same tokens.

    python benchmarks/vllm_quality.py [--model smollm2-135m] [--recipe out/recipe]
        [--method q3.5] [--text bbc] [--windows 8] [--length 2048] [--block-size 128]
        [--vllm-python .venv-vllm/bin/python] [--json benchmarks/results/vllm.json]

Windows of `--length` tokens spread over the evaluation text (`evaluation_windows`, as every perplexity of the
project) are scored teacher-forced four ways, all in float32:

* vLLM's engine with the kvsqueeze backend serving the method (`kvsqueeze.serving.vllm_run --score`: the
  log-probability vLLM's `prompt_logprobs` gives each token, and its first choice there), and vLLM's engine with
  its own backend and unquantized cache: the change in perplexity through vLLM;
* kvsqueeze's HF path, the same method in its compressed cache (`cache_for`: the store `generate` fills), and
  the fp16 cache: the change in perplexity with its paired 95% interval over the windows, KL divergence and
  top-1 agreement.

KL divergence through vLLM is taken from the whole distribution at every scored position: both engines run with
`vllm_run --logits`, which keeps the log-softmax rows the engine computes its prompt logprobs from (checked
against the logprobs it returns), and the kvsqueeze engine's rows are compared with vLLM's own backend's. The
HF path's mean KL gets a 95% interval over the windows (`mean_interval`); `kld_inside_hf_interval` says whether
vLLM's mean lies in it, and `kld_paired_ci95` is the interval of vLLM's minus the HF path's, window by window.

A bug in the pages (codes written to the wrong slot, a wrong page size, keys turned by the wrong angles, a layer
reading another layer's pages) moves vLLM's figure far outside the HF path's interval; float rounding does not.
Also written: the page bytes per token the engine holds (the layers' pages) beside the registry's bytes per
token of the same method (what one more token costs the HF store), the token slots of both engines, and for a
method with an fp16 window what its pages cost (`window`: per decoding sequence, in the blocks both KV groups
share).

The results go into `--json` under `quality`, with the top-level keys `served_method`, `page_bytes_per_token`,
`registry_bytes_per_token` and `ppl_inside_hf_interval`; the file's other measurements are kept.
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
from common import machine, merge_json, serving_arguments, serving_setup, vllm_engine  # noqa: E402

def token_bytes(config, layers: int, channels: int, head_dim: int, block_size: int) -> dict:
    """Bytes per token of the served method: the layers' pages (`page_bytes / block_size`), the registry's
    marginal count (what one more token costs the HF store, every layer), and the pages' parts that are not
    per-token data (each page's sink area and region alignment)."""
    from kvsqueeze.methods import family
    from kvsqueeze.storage import Rows, total

    spec, recipe = config.spec, config._recipe
    fam = family(spec)
    page = registry = overhead = pointers = 0.0
    for layer in range(layers):
        layout = config.layout(layer, channels, head_dim, block_size)
        bs = block_size
        page += layout.page_bytes / bs
        data = sum(r.nbytes for name, r in layout.regions.items() if not name.startswith("sink"))
        overhead += (layout.page_bytes - data) / bs
        a, b = (fam.layer_bytes(spec, recipe, layer, channels, head_dim, Rows(n)) for n in (4096, 4097))
        registry += total(b) - total(a)
        pointers += b["pointers"] - a["pointers"]
    out = {"page_bytes_per_token": round(page, 3), "registry_bytes_per_token": round(registry, 3),
           "page_overhead_bytes_per_token": round(overhead, 3), "registry_pointer_bytes_per_token": round(pointers, 3),
           "page_data_equals_registry": bool(abs(page - overhead - registry) < 1e-6)}
    if spec.window:
        out["window"] = window_bytes(spec.window, layers, channels, block_size, page * block_size)
    return out


def vllm_kld(reference: Path, served: Path) -> float:
    """Summed KL divergence of the served engine's distributions from the reference engine's, over the positions
    of one window (`vllm_run --logits` files, float32 [positions, vocab]); both files are deleted once read."""
    import numpy as np

    ref, mine = (torch.from_numpy(np.load(p)) for p in (reference, served))
    if ref.shape != mine.shape:
        raise SystemExit(f"{reference} and {served} hold {tuple(ref.shape)} and {tuple(mine.shape)} log-probabilities")
    kld = (ref.exp() * (ref - mine)).sum(-1).clamp_min(0)
    reference.unlink()
    served.unlink()
    return float(kld.double().sum())


def window_bytes(window: int, layers: int, channels: int, block_size: int, pages_per_block: float) -> dict:
    """What the fp16 window costs in vLLM (`WindowStore`): its entry (every layer's fp16 keys and values of one
    token), its pages, the block size in bytes of the pool both KV groups share (the larger of one block of the
    layers' pages and one window page), and the window pages a decoding sequence holds (its last `window`
    tokens, the new one included, may straddle one more page), beside the fp16 window the registry counts."""
    from kvsqueeze.serving.settings import window_page_tokens

    entry = layers * 2 * channels * 2
    tokens = window_page_tokens(block_size, round(pages_per_block), entry)
    page = tokens * entry
    block = max(round(pages_per_block), page)
    held = -(-window // tokens) + 1
    return {"tokens": window, "entry_bytes": entry, "page_tokens": tokens, "page_bytes": page, "block_bytes": block,
            "block_grows": page > round(pages_per_block), "pages_per_decoding_sequence": held,
            "bytes_per_decoding_sequence": held * block, "registry_bytes": window * entry,
            "tokens_of_codes_per_decoding_sequence": round(held * block / pages_per_block * block_size)}


def sizes_only(args, config, served: str) -> int:
    """Recount the served method's bytes (no engine runs) into the JSON's quality section, where it measured
    that method."""
    from kvsqueeze.integrations.loading import load_model
    from kvsqueeze.integrations.cache import kv_shape

    whole = json.loads(Path(args.json).read_text())
    quality = whole.get("quality", {})
    if quality.get("served_method") != served:
        raise SystemExit(f"{args.json} measured {quality.get('served_method')!r}, not {served!r}: run it in full")
    model, _ = load_model(args.model, "float32")
    shape = kv_shape(model.config)
    sizes = token_bytes(config, shape.layers, shape.channels, shape.head_dim, quality["block_size"])
    for stale in set(quality) & {"page_data_equals_registry_without_pointers", "window"}:
        quality.pop(stale)
    quality.update(sizes)
    merge_json(args.json, quality=quality, page_bytes_per_token=sizes["page_bytes_per_token"],
               registry_bytes_per_token=sizes["registry_bytes_per_token"])
    print(json.dumps(sizes, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serving_arguments(ap)
    ap.add_argument("--text", default="bbc")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--sizes-only", action="store_true",
                    help="only the byte counts (page, registry, window) of the method, into the JSON's `quality`")
    args = ap.parse_args(argv)

    from transformers import DynamicCache

    from kvsqueeze.eval.long_ppl import check_head, hidden_states, score_window
    from kvsqueeze.eval.perplexity import mean_interval, paired_interval
    from kvsqueeze.eval.texts import evaluation_windows, load_text
    from kvsqueeze.integrations.cache import cache_for, kv_shape
    from kvsqueeze.integrations.loading import load_model, resolve_model_path
    from kvsqueeze.serving.settings import ServingConfig

    py, recipe, served = serving_setup(args)  # `served`: ':kslotsN' resolved; the HF path runs the same name
    config = ServingConfig(recipe, served)
    if args.sizes_only:
        return sizes_only(args, config, served)
    model, tok = load_model(args.model, "float32")
    shape = kv_shape(model.config)
    ew = evaluation_windows(tok, load_text(args.text), args.length, args.windows)
    check_head(model, ew.ids[:1], DynamicCache)  # scores from hidden states: refuse a model whose logits are not that
    windows = [w.tolist() for w in ew.ids]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        (tmp / "windows.json").write_text(json.dumps(windows))
        common = ["--model", resolve_model_path(args.model), "--dtype", "float32", "--max-model-len",
                  str(args.length + 16), "--kv-bytes", str(1 << 30), "--block-size", str(args.block_size),
                  "--prompts", str(tmp / "windows.json"), "--skip-tokenizer-init", "--score"]
        ours = vllm_engine(py, [*common, "--backend", "kvsqueeze", "--recipe", recipe, "--method", served,
                                "--logits", str(tmp / "ours")], tmp, "quality-kvsqueeze")
        own = vllm_engine(py, [*common, "--backend", "vllm", "--logits", str(tmp / "own")], tmp, "quality-vllm")
        v_kld = [vllm_kld(tmp / "own" / f"prompt_{i}.npy", tmp / "ours" / f"prompt_{i}.npy")
                 for i in range(len(windows))]
    vllm_seconds = time.perf_counter() - started

    t0 = time.perf_counter()
    hf_m, hf_f, tokens, hf_kld, top1 = [], [], [], [], 0
    for ids in ew.ids:
        ids = ids.view(1, -1)
        with cache_for(model, recipe, "fp16") as cache:
            ref = hidden_states(model, ids, cache)
        with cache_for(model, recipe, served) as cache:
            hid = hidden_states(model, ids, cache)
        base, mine = score_window(model, ids, ref, ref, args.length), score_window(model, ids, hid, ref, args.length)
        hf_f.append(sum(base.nll))
        hf_m.append(sum(mine.nll))
        tokens.append(sum(mine.tokens))
        hf_kld.append(mine.kld_sum)
        top1 += mine.top1
    hf_seconds = time.perf_counter() - t0

    v_m = [-sum(s["logprob"]) for s in ours["scores"]]
    v_o = [-sum(s["logprob"]) for s in own["scores"]]
    if [len(s["logprob"]) for s in ours["scores"]] != tokens or [len(s["logprob"]) for s in own["scores"]] != tokens:
        raise SystemExit("vLLM scored another number of tokens than the HF path")
    count = float(sum(tokens))
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    change = lambda a, b: 100 * math.expm1((sum(a) - sum(b)) / count)  # noqa: E731
    ci = paired_interval(t(hf_m), t(hf_f), t(tokens))
    hf_delta, vllm_delta = change(hf_m, hf_f), change(v_m, v_o)
    agree = sum(a == b for s, r in zip(ours["scores"], own["scores"]) for a, b in zip(s["top1"], r["top1"]))
    inside = ci is not None and ci[0] <= vllm_delta <= ci[1]
    kld_ci = mean_interval(t(hf_kld), t(tokens))
    kld_vllm = sum(v_kld) / count
    kld_inside = kld_ci is not None and kld_ci[0] <= kld_vllm <= kld_ci[1]
    kld_paired = mean_interval(t(v_kld) - t(hf_kld), t(tokens))
    sizes = token_bytes(config, shape.layers, shape.channels, shape.head_dim, args.block_size)
    quality = {
        "machine": machine(), "model": args.model, "recipe": args.recipe, "method": args.method,
        "served_method": served, "text": f"{args.text}, evaluation part", "windows": len(windows),
        "window_tokens": args.length, "tokens_scored": int(count), "block_size": args.block_size, "dtype": "float32",
        "hf": {"ppl_fp16": round(math.exp(sum(hf_f) / count), 4), "ppl": round(math.exp(sum(hf_m) / count), 4),
               "delta_pct": round(hf_delta, 3), "ci95": None if ci is None else [round(x, 3) for x in ci],
               "kld_mean": round(sum(hf_kld) / count, 5),
               "kld_ci95": None if kld_ci is None else [round(x, 5) for x in kld_ci],
               "top1_vs_fp16": round(top1 / count, 4),
               "seconds": round(hf_seconds, 1)},
        "vllm": {"ppl_own_backend": round(math.exp(sum(v_o) / count), 4),
                 "ppl": round(math.exp(sum(v_m) / count), 4), "delta_pct": round(vllm_delta, 3),
                 "kld_mean": round(kld_vllm, 5), "top1_vs_own_backend": round(agree / count, 4),
                 "kv_tokens": ours["kv_tokens"],
                 "kv_tokens_own_backend_float32": own["kv_tokens"], "seconds": round(vllm_seconds, 1)},
        "vllm_own_over_hf_fp16_ppl": round(math.exp((sum(v_o) - sum(hf_f)) / count), 5),
        "vllm_over_hf_ppl": round(math.exp((sum(v_m) - sum(hf_m)) / count), 5),
        "ppl_inside_hf_interval": inside,
        "kld_inside_hf_interval": kld_inside,
        "kld_paired_ci95": None if kld_paired is None else [round(x, 5) for x in kld_paired],
        **sizes,
        "how": "vllm.delta_pct: vLLM with the kvsqueeze backend against vLLM with its own unquantized float32 cache, "
               "token for token; hf.delta_pct: kvsqueeze's compressed cache against the fp16 cache on the same "
               "windows, with its paired 95% interval over windows (paired_interval); vllm.kld_mean: the whole "
               "distributions of the same two vLLM runs at every scored position (vllm_run --logits), "
               "hf.kld_mean with its 95% interval over windows (mean_interval); kld_paired_ci95: vLLM's KL minus "
               "the HF path's, window by window",
    }
    merge_json(args.json, quality=quality, served_method=served, page_bytes_per_token=sizes["page_bytes_per_token"],
               registry_bytes_per_token=sizes["registry_bytes_per_token"], ppl_inside_hf_interval=inside,
               kld_inside_hf_interval=kld_inside)
    print(json.dumps(quality, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
