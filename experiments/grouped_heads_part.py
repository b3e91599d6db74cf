"""What attending a part of the keys costs when the G query heads of a KV head run as G * Tq rows of it (keys read
in place) against each query head over its own copy of the keys (`repeat_interleave`, as before): the first part
of a windowed prefill chunk or question (`kernels.mixed._part`, the quantized keys every query reads; `_part`
groups queries of up to `GROUPED_ROWS` tokens and copies the keys for longer ones).

Shapes: SmolLM2-135M's (3 KV heads, 3 query heads each) for a 256-token prefill chunk over 1,800 older keys,
one row and 8 rows (vLLM's prefill chunks); Qwen2.5-Coder-0.5B's (2 KV heads, 7 query heads each) for 4 rows of a
32-token question over 32,768 keys (a RULER question). Random float32 and bfloat16 inputs; torch's CPU flash
attention, the threads torch has. Medians of `--repeats` calls after one untimed call; the largest difference
between the two outputs is recorded beside them.

    python experiments/grouped_heads_part.py [--json experiments/results/grouped_heads_part.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import decode_machine, median_ms  # noqa: E402

from kvsqueeze.kernels.mixed import _FLASH, _part  # noqa: E402

SHAPES = {  # name: (rows, KV heads, query heads per KV head, queries, keys, head_dim)
    "smollm2-135m prefill chunk, 1 row": (1, 3, 3, 256, 1800, 64),
    "smollm2-135m prefill chunk, 8 rows": (8, 3, 3, 256, 1800, 64),
    "qwen2.5-coder-0.5b question, 4 rows": (4, 2, 7, 32, 32768, 64),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "grouped_heads_part.json"))
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (b, h, group, tq, tk, d) in SHAPES.items():
            q = torch.randn(b, h * group, tq, d, generator=g).to(dtype)
            k, v = (torch.randn(b, h, tk, d, generator=g).to(dtype) for _ in range(2))

            def copied():
                return _FLASH(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), 0.0, False,
                              scale=d**-0.5)[:2]

            def grouped():
                return _part(q, k, v, d**-0.5, False)

            diff = float((copied()[0].float() - grouped()[0].float()).abs().max())
            before, after = median_ms(copied, args.repeats), median_ms(grouped, args.repeats)
            rows.append({"shape": name, "dtype": str(dtype).split(".")[-1], "copied_ms": before, "grouped_ms": after,
                         "speedup": round(before / after, 2), "max_abs_diff": diff})
            print(json.dumps(rows[-1]), flush=True)
    out = {"machine": decode_machine(), "threads": torch.get_num_threads(), "rows": rows,
           "timing": f"medians of {args.repeats} calls after one untimed call"}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
