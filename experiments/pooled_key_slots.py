"""Whether key outlier slots shared by a block of tokens keep what a per-token cap loses, on calibration parts only.

    python experiments/pooled_key_slots.py [--model smollm2-135m] [--recipe out/recipe] [--texts bbc,code]
        [--method nuq@3.5:r32:chan:kslots16] [--block 128] [--windows 4]
        [--json experiments/results/pooled_key_slots.json]

A per-token cap (`:kslotsN`) stores exactly N exact key elements per token: a token's outliers first, the
farthest past the range when it has more (the rest clip), then the in-range elements its codes round worst
(`VectorQuantizer._slots`). Here the same count is shared by each block of `--block` consecutive tokens: the
block's N x tokens exact elements go to its outliers first, the farthest past their ranges, wherever in the block
they are, then to the worst-rounded in-range elements. Only the choice of elements changes, so the stored bits are
the per-token cap's as `evaluate` counts them; a paged layout of it would add each token's count of exact
elements (one byte per token and layer). The choice looks at the whole block, as a store could once the block is
full (the fp16 window of the last 32 tokens covers part of the wait; the rest is not modelled).

Same windows as `experiments/kl_transfer.py` (spread over each text's calibration part; the evaluation part is
never read), so its rows for the uncapped and the per-token capped preset are the comparison; fp16 is scored
again here and must match theirs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvsqueeze.integrations.loading import load_model
from kvsqueeze.methods import parse_method
from kvsqueeze.numerics.quantizer import VectorQuantizer
from kvsqueeze.recipe import Recipe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from common import machine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kl_transfer import score_texts  # noqa: E402


def pooled(block: int):
    """A `VectorQuantizer._slots` whose exact elements are chosen per block of `block` tokens."""

    def choose(self, x, codes, scale, zero, past):
        err = (self._values(codes, scale, zero) - x).abs()  # an outlier's: its distance past the range
        err = torch.where(past, err + err.amax() + 1, err)  # every outlier of the block before any in-range one
        mask = torch.zeros_like(past)
        c = x.shape[1]
        for a in range(0, x.shape[0], block):
            piece = err[a:a + block].reshape(-1)
            k = min(self.slots * (piece.numel() // c), piece.numel())
            mask[a:a + block].view(-1)[piece.topk(k).indices] = True
        return mask

    return choose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="out/recipe")
    ap.add_argument("--texts", default="bbc,code")
    ap.add_argument("--method", default="nuq@3.5:r32:chan:kslots16")
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--json", default="experiments/results/pooled_key_slots.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    recipe = Recipe.load(args.recipe)
    specs = [parse_method("fp16"), parse_method(args.method)]
    if not specs[1].key_slots:
        raise SystemExit(f"--method {args.method!r} has no ':kslotsN': there is no cap to share")
    VectorQuantizer._slots = pooled(args.block)
    model, tok = load_model(args.model)
    payload = {"model": args.model, "recipe": args.recipe, "recipe_text": recipe.meta.get("text"),
               "method": args.method, "shared_by": f"blocks of {args.block} tokens", "seqlen": args.seqlen,
               "windows": args.windows, "machine": machine(), "texts": {}}
    score_texts(model, tok, recipe, ["fp16", args.method + " (pooled)"], specs, args.texts, args.windows,
                args.seqlen, payload, args.json)


if __name__ == "__main__":
    main()
