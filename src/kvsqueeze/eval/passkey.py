"""Passkey retrieval: a 5-digit key hidden at a chosen depth inside filler text.

This is the long-context sanity check KVQuant (arXiv 2401.18079) reports: the
model reads an instruction, many repetitions of an irrelevant filler paragraph
with one "pass key" sentence buried in it, and a final question; it must
continue `"The pass key is"` with the key.  A quantized KV cache that destroys
long-range retrieval shows up here long before it shows in perplexity.

The module is model-agnostic and does not import `transformers`: prompt
building takes any tokenizer-like object (`tokenizer(text)["input_ids"]` or
`tokenizer.encode(text)`), and `run_passkey` takes a `generate_fn`
that turns `(method, prompt)` into the generated continuation.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .fitting import largest_fitting
from .tables import text_table

__all__ = [
    "FILLER",
    "INTRO",
    "QUESTION",
    "PasskeyPrompt",
    "PasskeyResult",
    "build_passkey_prompt",
    "build_passkey_prompts",
    "count_tokens",
    "format_passkey_table",
    "key_sentence",
    "run_passkey",
    "score_passkey",
]

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"

_PASSKEY_MIN = 10000
_PASSKEY_MAX = 99999
# Filler repetitions tokenized together to estimate the per-repetition token cost.
_UNIT_PROBE = 32
_DIGITS = re.compile(r"[0-9]+")


def key_sentence(passkey: str) -> str:
    """The sentence that carries the key."""
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key."


@dataclass(frozen=True)
class PasskeyPrompt:
    """One passkey-retrieval prompt.

    `depth` is the requested depth in [0, 1] (fraction of the filler, counted
    in filler repetitions, that precedes the key sentence).  `n_tokens` is the
    tokenized prompt length including any special tokens the tokenizer adds.
    `key_token_start` is the (approximate) token index at which the key
    sentence starts, found by tokenizing the text before it.
    """

    text: str
    passkey: str
    depth: float
    n_tokens: int
    key_token_start: int
    seed: int


@dataclass
class PasskeyResult:
    """Exact-match accuracy of one method at one context length."""

    method: str
    length: int
    accuracy: float
    trials: int
    correct: int


# ---------------------------------------------------------------------------
# Tokenizer helpers
# ---------------------------------------------------------------------------


def _as_id_list(ids: Any) -> list[int]:
    """Normalise token ids (list, tuple, tensor, array; possibly a batch of one) to a list."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"expected token ids for one text, got a batch of {len(ids)}")
        ids = list(ids[0])
    return ids


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, with whatever special tokens the tokenizer adds by default."""
    if callable(tokenizer):
        out = tokenizer(text)
        if isinstance(out, Mapping) or hasattr(out, "keys"):
            if "input_ids" in out:
                return _as_id_list(out["input_ids"])
        elif not hasattr(tokenizer, "encode"):
            # A bare callable returning the ids directly.
            return _as_id_list(out)
    if hasattr(tokenizer, "encode"):
        return _as_id_list(tokenizer.encode(text))
    raise TypeError(
        "tokenizer must support tokenizer(text)['input_ids'] or tokenizer.encode(text); "
        f"got {type(tokenizer).__name__}"
    )


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens in `text` (special tokens included)."""
    return len(_token_ids(tokenizer, text))


# ---------------------------------------------------------------------------
# Prompt building
# ---------------------------------------------------------------------------


def _units_before(depth: float, n_units: int) -> int:
    """Filler repetitions placed before the key sentence (round half up)."""
    return min(n_units, max(0, int(depth * n_units + 0.5)))


def _assemble(passkey: str, n_units: int, depth: float) -> tuple[str, str]:
    """Return (full prompt text, text preceding the key sentence)."""
    n_before = _units_before(depth, n_units)
    before = " ".join([FILLER] * n_before)
    after = " ".join([FILLER] * (n_units - n_before))
    prefix_parts = [INTRO, before]
    parts = [*prefix_parts, key_sentence(passkey), after, QUESTION]
    text = "\n".join(p for p in parts if p)
    prefix = "\n".join(p for p in prefix_parts if p) + "\n"
    return text, prefix


def _check_length(length: Any) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise ValueError(f"length must be a positive int (tokens), got {length!r}")
    return length


def _check_depth(depth: Any) -> float:
    try:
        d = float(depth)
    except (TypeError, ValueError):
        raise ValueError(f"depth must be a number in [0, 1], got {depth!r}") from None
    if not (0.0 <= d <= 1.0):  # also rejects NaN
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    return d


def _fit_units(tokenizer: Any, passkey: str, depth: float, length: int) -> tuple[int, int]:
    """Largest filler-repetition count whose prompt fits in `length` tokens.

    Estimates from the measured cost of the fixed parts and of one filler
    repetition, then brackets and bisects with a handful of re-tokenizations.
    Returns (repetitions, token count of that prompt).
    """
    cache: dict[int, int] = {}

    def f(n: int) -> int:
        if n not in cache:
            cache[n] = count_tokens(tokenizer, _assemble(passkey, n, depth)[0])
        return cache[n]

    base = f(0)
    if base > length:
        raise ValueError(
            f"length={length} tokens is too small for a passkey prompt: the intro, the "
            f"pass-key sentence and the question alone take {base} tokens with this tokenizer"
        )

    specials = count_tokens(tokenizer, "")
    probe = count_tokens(tokenizer, " ".join([FILLER] * _UNIT_PROBE)) - specials
    unit = max(probe / _UNIT_PROBE, 1e-9)
    guess = max(0, int((length - base) / unit))
    # Each repetition is at least one character, so the count can never need to
    # exceed the number of characters a `length`-token prompt could plausibly hold;
    # this guards against tokenizers that silently truncate.
    cap = max(guess, length) * 4 + 16
    try:
        n = largest_fitting(f, length, guess=guess, cap=cap)
    except ValueError as e:
        raise RuntimeError(str(e)) from None
    return n, f(n)


def build_passkey_prompt(
    tokenizer: Any, length: int, seed: int, depth: float | None = None
) -> PasskeyPrompt:
    """Build one passkey prompt of at most `length` tokens (within one filler repetition).

    The passkey is a 5-digit number from `random.Random(seed)`; when `depth` is
    None it is drawn from the same generator, uniformly in [0, 1].
    """
    length = _check_length(length)
    if depth is not None:
        depth = _check_depth(depth)
    rng = random.Random(seed)
    passkey = str(rng.randint(_PASSKEY_MIN, _PASSKEY_MAX))
    if depth is None:
        depth = rng.random()

    n_units, n_tokens = _fit_units(tokenizer, passkey, depth, length)
    text, prefix = _assemble(passkey, n_units, depth)

    # Token index of the key sentence: where the ids of the preceding text stop
    # agreeing with the ids of the full prompt (skips trailing special tokens such
    # as EOS that the tokenizer appends to the prefix alone).
    full_ids = _token_ids(tokenizer, text)
    prefix_ids = _token_ids(tokenizer, prefix)
    start = 0
    for a, b in zip(prefix_ids, full_ids):
        if a != b:
            break
        start += 1

    return PasskeyPrompt(
        text=text,
        passkey=passkey,
        depth=depth,
        n_tokens=n_tokens,
        key_token_start=start,
        seed=seed,
    )


def _derive_seed(seed: int, length: int, trial: int) -> int:
    digest = hashlib.sha256(f"passkey:{seed}:{length}:{trial}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def build_passkey_prompts(
    tokenizer: Any, length: int, trials: int, seed: int = 0, depth: float | None = None
) -> list[PasskeyPrompt]:
    """`trials` prompts whose seeds derive deterministically from (seed, length, trial).

    Every method evaluated with the same arguments sees the same prompts.  `depth`
    (default None: drawn per prompt) fixes the key depth for all of them.
    """
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials must be an int >= 1, got {trials!r}")
    length = _check_length(length)
    return [
        build_passkey_prompt(tokenizer, length, _derive_seed(seed, length, i), depth)
        for i in range(trials)
    ]


# ---------------------------------------------------------------------------
# Scoring and running
# ---------------------------------------------------------------------------


def score_passkey(generated_text: str, passkey: str) -> bool:
    """Exact match: the first run of digits in the continuation equals the passkey."""
    m = _DIGITS.search(generated_text)
    return m is not None and m.group() == str(passkey)


def run_passkey(
    prompts_by_length: Mapping[int, Sequence[PasskeyPrompt]],
    methods: Sequence[str],
    generate_fn: Callable[[str, PasskeyPrompt], str],
    progress: bool = True,
) -> list[PasskeyResult]:
    """Evaluate every method on every prompt; one result per (method, length).

    `generate_fn(method, prompt)` returns the generated continuation of
    `prompt.text`.  Results are ordered by method, then by length as given.
    """
    from tqdm.auto import tqdm

    for length, prompts in prompts_by_length.items():
        if len(prompts) == 0:
            raise ValueError(f"no prompts for length {length}")
    total = len(methods) * sum(len(p) for p in prompts_by_length.values())
    results: list[PasskeyResult] = []
    with tqdm(total=total, desc="passkey", disable=not progress) as bar:
        for method in methods:
            for length, prompts in prompts_by_length.items():
                bar.set_postfix_str(f"{method} @ {length}")
                correct = 0
                for prompt in prompts:
                    if score_passkey(generate_fn(method, prompt), prompt.passkey):
                        correct += 1
                    bar.update(1)
                n = len(prompts)
                results.append(
                    PasskeyResult(
                        method=method,
                        length=int(length),
                        accuracy=correct / n,
                        trials=n,
                        correct=correct,
                    )
                )
    return results


def format_passkey_table(results: Sequence[PasskeyResult]) -> str:
    """Plain-text table: rows = methods, columns = lengths, cells = accuracy."""
    if not results:
        return "Passkey retrieval accuracy: no results"
    methods = list(dict.fromkeys(r.method for r in results))
    lengths = sorted({r.length for r in results})
    cell = {(r.method, r.length): r for r in results}

    trial_counts = {r.trials for r in results}
    if len(trial_counts) == 1:
        title = (
            f"Passkey retrieval accuracy (exact match, {trial_counts.pop()} trials per cell)"
        )
        col_names = [str(n) for n in lengths]
    else:
        title = "Passkey retrieval accuracy (exact match; trials per column in header)"
        col_names = []
        for n in lengths:
            counts = sorted({r.trials for r in results if r.length == n})
            col_names.append(f"{n} (n={'/'.join(map(str, counts))})")

    body = [[m] + ["-" if (m, n) not in cell else f"{cell[(m, n)].accuracy:.2f}" for n in lengths]
            for m in methods]
    return text_table(["method", *col_names], body, title=title)
