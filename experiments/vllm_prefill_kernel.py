"""Would vLLM's own CPU attention kernel make the vLLM backend's prefill faster, and can the backend use it?

The backend's prefill attends a chunk's queries over the sequence's keys with torch's CPU flash attention
(`kernels.mixed`): with an fp16 window it is three attentions merged by their log-sum-exps. vLLM's CPU backend
runs its own kernel (`cpu_attention_with_kv_cache`, over bf16 pages written by `cpu_attn_reshape_and_cache`).
This probe times that kernel, causal, against torch's attention on the same queries, keys and values: SDPA with
the causal mask (bf16 and float32) and the flash kernel that returns the log-sum-exp (`mixed`'s, unmasked, GQA
heads repeated as `mixed` repeats them), after checking vLLM's output against SDPA's. The default shape is the
default model's layer (9 query heads over 3 KV heads of 64), pages of 128 tokens. Run it with vLLM's python:

    .venv-vllm/bin/python experiments/vllm_prefill_kernel.py [--shapes 1024x256,2048x256,2048x2048]
        [--rounds 15] [--json experiments/results/vllm_prefill_kernel.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

try:  # before benchmarks/ joins the path: its vllm.py would shadow the package
    import vllm._custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
except ImportError as exc:
    raise SystemExit(f"vLLM is not importable here ({exc}): run this with .venv-vllm/bin/python "
                     "(`make vllm-setup`)") from None

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine, median_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1024x256,2048x256,2048x2048", help="KEYSxQUERIES, comma-separated")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", default="experiments/results/vllm_prefill_kernel.json")
    args = ap.parse_args()
    hq, h, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    dt, scale, g = torch.bfloat16, d**-0.5, torch.Generator().manual_seed(0)
    isa = _get_attn_isa(dt, bs, d)
    rows = []
    for shape in args.shapes.split(","):
        t, nq = (int(x) for x in shape.split("x"))
        q = torch.randn(nq, hq, d, generator=g).to(dt)
        k, v = (torch.randn(t, h, d, generator=g).to(dt) for _ in range(2))
        blocks = (t + bs - 1) // bs
        kc, vc = torch.zeros(blocks, h, 2 * bs, d, dtype=dt).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(t), isa)
        starts, lens = torch.tensor([0, nq], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
        table = torch.arange(blocks, dtype=torch.int32).view(1, -1)
        meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=hq, num_kv_heads=h, head_dim=d, seq_lens=lens,
                                                   dtype=dt, query_start_loc=starts, causal=True,
                                                   sliding_window_size=-1, isa=isa, enable_kv_split=False)
        out = torch.empty(nq, hq, d, dtype=dt)

        def own():
            ops.cpu_attention_with_kv_cache(query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=starts,
                                            seq_lens=lens, scale=scale, causal=True, alibi_slopes=None,
                                            sliding_window=-1, block_table=table, softcap=0.0,
                                            scheduler_metadata=meta, s_aux=None)

        allowed = torch.arange(t).view(1, -1) <= torch.arange(t - nq, t).view(-1, 1)  # [Q, T]: the last Q queries
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, T, D]
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def masked(dtype):
            qd, kd, vd = qt.to(dtype), kt.to(dtype), vt.to(dtype)
            return lambda: sdpa(qd, kd, vd, attn_mask=allowed, scale=scale, enable_gqa=True)

        kr, vr = kt.repeat_interleave(hq // h, 1), vt.repeat_interleave(hq // h, 1)
        flash_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

        def flash():
            return flash_for_cpu(qt, kr, vr, scale=scale)

        own()
        want = masked(torch.float32)()[0].transpose(0, 1)
        err = float((out.float() - want).abs().max())
        if err > 0.05:  # bf16 inputs and output: about 2**-8 of values of order one
            raise SystemExit(f"vLLM's kernel differs from SDPA by {err:.3g} at {t} keys x {nq} queries")
        row = {"keys": t, "queries": nq, "isa": isa, "max_abs_error_vs_float32_sdpa": round(err, 5),
               "vllm_kernel_ms": median_ms(own, args.rounds, 3),
               "torch_sdpa_causal_mask_bf16_ms": median_ms(masked(dt), args.rounds, 3),
               "torch_sdpa_causal_mask_fp32_ms": median_ms(masked(torch.float32), args.rounds, 3),
               "torch_flash_with_lse_bf16_no_mask_ms": median_ms(flash, args.rounds, 3)}
        row["vllm_speedup_over_sdpa_bf16"] = round(row["torch_sdpa_causal_mask_bf16_ms"] / row["vllm_kernel_ms"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"machine": machine(), "threads": torch.get_num_threads(), "load_average_start": list(os.getloadavg()),
              "shape": {"query_heads": hq, "kv_heads": h, "head_dim": d, "block_size": bs},
              "timing": "median wall ms over --rounds calls after one untimed call; other jobs may run beside it "
                        "(load_average_start)",
              "what_it_lacks": "the kernel returns the normalised output only, no log-sum-exp: a chunk whose "
                               "queries read their window exact and older keys quantized cannot merge its parts "
                               "with it (kernels.mixed merges by log-sum-exp)",
              "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
