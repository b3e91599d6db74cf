"""How far float rounding moves a quantized cache's logits: the same tokens scored in a shorter and a longer forward.

    python benchmarks/prefix_consistency.py [--model smollm2-135m] [--recipe out/recipe]
        [--methods fp16,nuq4,nuq3-1%:kslots6] [--offset 2000] [--tokens 300] [--prefix 200]
        [--json benchmarks/results/prefix_consistency.json]

`--tokens` tokens of the BBC evaluation text go through the HF path's cache (`cache_for`) in one forward, and
their first `--prefix` tokens in another. Causal attention makes the first `--prefix` positions' logits the same
function of the same tokens; they differ only by float rounding, which changes with the sequence length (the
attention kernel blocks its work by it). An fp16 cache rounds every key and value to fp16, a quantized cache to its
codes: an element near a rounding boundary lands on the other side, and the difference carries to every later
query. Written per method: the largest difference of any log-probability, the largest and the median difference
of the log-probability of the text's next token, over the first `--prefix` positions, and the first position
that moves by more than 1e-3. This is why greedy tokens of two correct engines part (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="out/recipe")
    ap.add_argument("--methods", default="fp16,nuq4,nuq3-1%:kslots6")
    ap.add_argument("--offset", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--json", default="benchmarks/results/prefix_consistency.json")
    args = ap.parse_args(argv)
    if not 1 < args.prefix < args.tokens:
        raise SystemExit("--prefix must be between 2 and --tokens")

    from kvsqueeze.eval.texts import load_text
    from kvsqueeze.integrations.cache import cache_for
    from kvsqueeze.integrations.loading import load_model

    model, tok = load_model(args.model, "float32")
    ids = tok(load_text("bbc").evaluation, add_special_tokens=False).input_ids[args.offset:args.offset + args.tokens]
    ids = torch.tensor([ids])
    rows = []
    with torch.no_grad():
        for method in args.methods.split(","):
            with cache_for(model, args.recipe, method) as cache:
                whole = model(ids, cache=cache).logits[0, : args.prefix].float().log_softmax(-1)
            with cache_for(model, args.recipe, method) as cache:
                short = model(ids[:, : args.prefix], cache=cache).logits[0].float().log_softmax(-1)
            d = (whole - short).abs()
            nxt = ids[0, 1 : args.prefix + 1].view(-1, 1)
            dn = (whole.gather(1, nxt) - short.gather(1, nxt)).abs().view(-1)
            moved = (d.amax(-1) > 1e-3).nonzero()
            rows.append({"method": method, "max_abs_logprob_diff": round(float(d.max()), 5),
                         "next_token_logprob_diff_max": round(float(dn.max()), 5),
                         "next_token_logprob_diff_median": float(dn.median()),
                         "first_position_moved": int(moved[0]) if moved.numel() else None})
            print(rows[-1], flush=True)
    out = {"machine": machine(), "model": args.model, "recipe": args.recipe, "text": "bbc, evaluation part",
           "offset": args.offset, "tokens": args.tokens, "prefix": args.prefix, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
