"""Long-context evaluation: passkey retrieval through a quantized KV cache.

Generation is greedy, over the same seeded prompts for every method, through
either engine: "sim" (simulated quantization: every prompt and generated token
is quantized as it enters the cache) or "cache" (the compressed cache of
`kvsqueeze.cache_for`, for the methods it stores; others fall back to "sim").
The two agree token for token (tests/eval/test_longctx.py).
"""

from __future__ import annotations

import torch

from ..config import PasskeyConfig
from ..integrations.simulate import SimulatedQuantization
from ..methods import MethodSpec
from ..recipe import Recipe
from ..shape import context_length
from .passkey import PasskeyPrompt, PasskeyResult, build_passkey_prompts, run_passkey

ANSWER_TOKENS = 8  # a 5-digit key plus a space and punctuation, whatever the tokenizer


ENGINES = ("sim", "cache")


@torch.no_grad()
def greedy_answer(model, tok, text: str, cache, max_new_tokens: int = ANSWER_TOKENS) -> str:
    """Greedy continuation of `text` through `cache` (a fresh transformers Cache)."""
    ids = tok(text, return_tensors="pt")["input_ids"].to(next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _cache_engine_supports(spec: MethodSpec) -> bool:
    from ..integrations.prefill import compressed

    return compressed(spec)


def passkey_eval(model, tok, specs: list[MethodSpec], lengths: list[int], trials: int = PasskeyConfig.trials,
                 recipe: Recipe | None = None, seed: int = PasskeyConfig.seed, progress: bool = True,
                 engine: str = PasskeyConfig.engine) -> list[PasskeyResult]:
    """Exact-match passkey accuracy for each method and prompt length (same prompts for all methods)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    limit = context_length(model.config)
    for n in lengths:
        if n < 1:
            raise ValueError(f"passkey length must be positive, got {n}")
        if limit and n > limit:
            raise ValueError(f"passkey length {n} exceeds the model's {limit}-token context; use lengths up to {limit}")
    # at the model's full context the prompt leaves room for the answer
    prompts = {n: build_passkey_prompts(tok, min(n, limit - ANSWER_TOKENS) if limit else n, trials, seed=seed)
               for n in lengths}
    by_name = {s.name: s for s in specs}
    sims: dict[str, SimulatedQuantization] = {}

    def generate(method: str, prompt: PasskeyPrompt) -> str:
        if engine == "cache" and _cache_engine_supports(by_name[method]):
            from ..integrations.cache import cache_for

            for s in sims.values():  # a simulation's hooks would quantize before the cache does
                s.__exit__(None, None, None)
            sims.clear()
            with cache_for(model, recipe, by_name[method]) as cache:
                return greedy_answer(model, tok, prompt.text, cache)
        if method not in sims:
            for s in sims.values():
                s.__exit__(None, None, None)
            sims.clear()
            sims[method] = SimulatedQuantization(model, by_name[method], recipe).__enter__()
        return greedy_answer(model, tok, prompt.text, sims[method].new_cache())

    try:
        return run_passkey(prompts, [s.name for s in specs], generate, progress=progress)
    finally:
        for s in sims.values():
            s.__exit__(None, None, None)
