"""Decode attention over a paged cache: the numba kernel reading the pages in place against reading a gathered copy.

What the vLLM backend does for the decode tokens of a batch, one layer: build the view of B sequences of T tokens
from their block tables (`PageLayout.view`) and run `decode_attention` on it. In place, the view names each
token's slot and the kernel reads the pages where they are; gathered, the pages are first copied into the
token-major arrays the kernel reads otherwise. Pages hold the default model's recipe (its middle layer,
`nuq3-1%:kslots6`, blocks of 128), filled with random keys and values, the blocks shuffled. Both results are
checked against the reference backend before timing; the two are timed interleaved, view included.

    python benchmarks/paged_decode.py [--shapes 8x2048,8x8192,1x32768] [--rounds 15]
        [--json benchmarks/results/paged_decode.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvsqueeze.kernels import Rope, decode_attention
from kvsqueeze.methods import parse_method
from kvsqueeze.paged.layout import PageLayout

sys.path.insert(0, str(Path(__file__).parent))
from common import DEFAULT_RECIPE, decode_machine, prepare, quantizers, shape  # noqa: E402


def filled_pages(layout: PageLayout, batch: int, tokens: int, g: torch.Generator):
    """(pages, block table int32 [B, pages each], lengths [B]): `batch` sequences of `tokens` random keys and values
    written into shuffled pages of a buffer with three spare pages."""
    bs, c = layout.block_size, layout.channels
    per = -(-tokens // bs)
    pages = layout.allocate(batch * per + 3)
    table = torch.randperm(pages.shape[0], generator=g)[:batch * per].view(batch, per).to(torch.int32)
    for b in range(batch):
        pos = torch.arange(tokens)
        slots = table[b, pos // bs].long() * bs + pos % bs
        layout.write(pages, slots, torch.randn(tokens, c, generator=g), torch.randn(tokens, c, generator=g), pos)
    return pages, table, torch.full((batch,), tokens)


def run(layout: PageLayout, hq: int, d: int, batch: int, tokens: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    pages, table, lens = filled_pages(layout, batch, tokens, g)
    q = torch.randn(batch, hq, d, generator=g)
    rope = Rope.default(d)

    def call(in_place: bool, backend: str = "numba") -> torch.Tensor:
        view, mask = layout.view(pages, table, lens, in_place=in_place)
        return decode_attention(q, view, rope, d**-0.5, key_mask=mask, backend=backend)

    want = call(False, "reference")
    for in_place in (False, True):  # the fast results against the reference, before any timing
        torch.testing.assert_close(call(in_place), want, rtol=2e-4, atol=2e-5)
    times = {"in place": [], "gathered copy": []}
    for r in range(rounds):
        order = list(times) if r % 2 == 0 else list(times)[::-1]
        for name in order:
            t0 = time.perf_counter()
            call(name == "in place")
            times[name].append(time.perf_counter() - t0)
    med = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    return {"batch": batch, "tokens": tokens, "median_ms": med,
            "in_place_over_gathered": round(med["in place"] / med["gathered copy"], 3)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x2048,8x8192,1x32768", help="BATCHxTOKENS, comma-separated")
    p.add_argument("--method", default="nuq3-1%:kslots6")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--recipe", default=DEFAULT_RECIPE)
    p.add_argument("--json", default=str(Path(__file__).parent / "results" / "paged_decode.json"))
    args = p.parse_args(argv)
    if not (Path(args.recipe) / "recipe.json").is_file():
        raise SystemExit(f"no recipe at {args.recipe}: run `make demo` (it writes out/recipe) or give --recipe DIR")
    recipe = prepare(args.threads, args.recipe)
    hq, h, d = shape(argparse.Namespace(heads=None, kv_heads=None, head_dim=None), recipe)
    kq, vq = quantizers(args.method, recipe, h * d)
    layout = PageLayout(kq, vq, h * d, d, args.block_size, sinks=parse_method(args.method).sinks)
    rows = []
    for size in args.shapes.split(","):
        batch, tokens = (int(x) for x in size.split("x"))
        rows.append(run(layout, hq, d, batch, tokens, args.rounds))
        print(json.dumps(rows[-1]), flush=True)
    out = {"machine": decode_machine(), "recipe": args.recipe, "method": args.method,
           "block_size": args.block_size, "shape": {"query_heads": hq, "kv_heads": h, "head_dim": d},
           "timing": f"median of {args.rounds} interleaved rounds; one layer's decode_attention, view included",
           "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
