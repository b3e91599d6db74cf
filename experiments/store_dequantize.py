"""What reading a whole compressed cache back costs, with torch's ops (the reference) and with numba's compiled
pass: the read a forward of several tokens makes of every layer (a long-context question, a prefill chunk after
the first). And what filling it costs: one prompt appended in one call (its sinks, then the rest), with the
torch ops (`encoder="torch"`) and with the CPU's default (the sinks through torch, the rest in one numba call);
the two stores are checked equal array by array.

The stores are `benchmarks/decode.py --step`'s (synthetic heavy-tailed keys and values, the recipe's middle
layer, SmolLM2-135M's layer shape), with `--rows` batch rows each; both results are checked equal bit for bit
before timing. Medians over `--repeats` calls, in milliseconds.

    python experiments/store_dequantize.py [--methods nuq3-1%,nuq@3.5:r32:chan] [--contexts 2048,8192,32768]
        [--rows 1,8] [--json experiments/results/store_dequantize.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import (DEFAULT_RECIPE, decode_machine, fill_store, median_ms, prepare, quantizers,  # noqa: E402
                    step_inputs)

from kvsqueeze.cache.positions import PositionLog  # noqa: E402
from kvsqueeze.cache.store import KVStore  # noqa: E402
from kvsqueeze.kernels.numba.dequant import dequantize_view as compiled  # noqa: E402
from kvsqueeze.kernels.reference import dequantize_view as reference  # noqa: E402
from kvsqueeze.methods import parse_method  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="nuq3-1%,nuq@3.5:r32:chan")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "experiments" / "results" / "store_dequantize.json"))
    args = ap.parse_args()
    recipe = prepare(2, DEFAULT_RECIPE)
    _, _, _, _, _, q, k1, _ = step_inputs(recipe)
    c, d = k1.shape[-1], q.shape[-1]
    rows = []
    for method in args.methods.split(","):
        kq, vq = quantizers(method, recipe, c)
        for t in (int(x) for x in args.contexts.split(",")):
            for batch in (int(x) for x in args.rows.split(",")):
                store = fill_store(kq, vq, t, c, d, parse_method(method).sinks, PositionLog(), batch=batch)
                view = store.view()
                for got, want in zip(compiled(view), reference(view)):
                    if not torch.equal(got, want):
                        raise SystemExit(f"{method} at {t} tokens x {batch} rows: numba differs from the reference")
                ref_ms, fast_ms = median_ms(lambda: reference(view), args.repeats), median_ms(lambda: compiled(view),
                                                                                           args.repeats)
                fill = {}
                if batch == 1:
                    keys, values = (x.transpose(0, 1).contiguous() for x in store.dequantize())  # [1, T, C]
                    for encoder in ("torch", "auto"):
                        def append(encoder=encoder):
                            s = KVStore(kq, vq, c, parse_method(method).sinks, head_dim=d, positions=PositionLog(),
                                        encoder=encoder)
                            s.append(keys, values)
                            return s
                        fill[encoder] = median_ms(append, max(1, args.repeats // 2))
                        made = append()
                        if encoder == "torch":
                            plain = made
                    for got, want in zip(made.dequantize(), plain.dequantize()):
                        if not torch.equal(got, want):
                            raise SystemExit(f"{method} at {t} tokens: the two encoders' stores differ")
                rows.append({"method": method, "context": t, "rows": batch, "reference_ms": ref_ms, "numba_ms": fast_ms,
                             "speedup": round(ref_ms / fast_ms, 1),
                             **({"append_torch_ms": fill["torch"], "append_numba_ms": fill["auto"]} if fill else {})})
                print(json.dumps(rows[-1]), flush=True)
    out = {"machine": decode_machine(), "threads": torch.get_num_threads(),
           "store": "benchmarks/decode.py's synthetic store, the recipe's middle layer (SmolLM2-135M: 3 KV heads x 64)",
           "timing": f"medians of {args.repeats} calls after one untimed call, each checked equal bit for bit first",
           "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
