"""Tests for kvsqueeze.eval.passkey with small stub tokenizers (no model loads)."""

from __future__ import annotations

import re

import pytest

from kvsqueeze.eval.passkey import (
    FILLER,
    INTRO,
    QUESTION,
    PasskeyPrompt,
    PasskeyResult,
    build_passkey_prompt,
    build_passkey_prompts,
    count_tokens,
    format_passkey_table,
    run_passkey,
    score_passkey,
)

KEY_RE = re.compile(r"The pass key is (\d{5})\. Remember it\. (\d{5}) is the pass key\.")


class WordTokenizer:
    """Whitespace tokenizer with a BOS token; supports both __call__ and encode."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [0] + [self.vocab.setdefault(w, len(self.vocab) + 1) for w in text.split()]

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}


class CharCallTokenizer:
    """Character tokenizer that only supports __call__ and appends an EOS token."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text] + [-1]}


class EncodeOnlyTokenizer:
    """Two characters per token, BOS added, only an encode method."""

    def encode(self, text: str) -> list[int]:
        return [1] + [hash(text[i : i + 2]) & 0xFFFF for i in range(0, len(text), 2)]


TOKENIZERS = [WordTokenizer(), CharCallTokenizer(), EncodeOnlyTokenizer()]
TOK_IDS = ["word", "char-call", "encode-only"]


def _unit_tokens(tok) -> int:
    """Token cost of one filler repetition (plus its joining space)."""
    return count_tokens(tok, FILLER + " " + FILLER) - count_tokens(tok, FILLER)


def _filler_fraction_before_key(p: PasskeyPrompt) -> tuple[int, int]:
    """(filler repetitions before the key sentence, total filler repetitions)."""
    m = KEY_RE.search(p.text)
    assert m is not None
    before = p.text[: m.start()].count(FILLER)
    total = p.text.count(FILLER)
    return before, total


def test_module_does_not_import_transformers() -> None:
    import importlib

    mod = importlib.import_module("kvsqueeze.eval.passkey")
    src = open(mod.__file__, encoding="utf-8").read()
    assert not re.search(r"^\s*(import|from)\s+transformers", src, flags=re.M)


def test_prompt_structure_and_key_recoverable() -> None:
    tok = WordTokenizer()
    p = build_passkey_prompt(tok, 500, seed=3, depth=0.5)
    assert p.text.startswith(INTRO)
    assert p.text.endswith(QUESTION)
    assert FILLER in p.text
    m = KEY_RE.search(p.text)
    assert m is not None
    assert m.group(1) == m.group(2) == p.passkey
    assert len(p.passkey) == 5 and 10000 <= int(p.passkey) <= 99999
    assert len(KEY_RE.findall(p.text)) == 1
    assert p.seed == 3 and p.depth == 0.5
    assert p.n_tokens == count_tokens(tok, p.text)


def test_prompts_are_seeded() -> None:
    tok = WordTokenizer()
    a = build_passkey_prompt(tok, 400, seed=11)
    b = build_passkey_prompt(tok, 400, seed=11)
    assert a == b
    assert 0.0 <= a.depth <= 1.0

    ps1 = build_passkey_prompts(tok, 400, trials=6, seed=0)
    ps2 = build_passkey_prompts(tok, 400, trials=6, seed=0)
    assert [p.text for p in ps1] == [p.text for p in ps2]
    assert len({p.seed for p in ps1}) == 6
    # Different trials carry different keys (and the seed changes the whole set).
    assert len({p.passkey for p in ps1}) > 1
    assert ps1[0].passkey != ps1[1].passkey
    ps3 = build_passkey_prompts(tok, 400, trials=6, seed=1)
    assert [p.passkey for p in ps3] != [p.passkey for p in ps1]
    # Seeds also depend on the length, so another length gets other prompts.
    ps4 = build_passkey_prompts(tok, 800, trials=6, seed=0)
    assert [p.seed for p in ps4] != [p.seed for p in ps1]


def test_build_prompts_fixed_depth_and_bad_trials() -> None:
    tok = WordTokenizer()
    ps = build_passkey_prompts(tok, 300, trials=3, seed=5, depth=0.25)
    assert all(p.depth == 0.25 for p in ps)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="trials"):
            build_passkey_prompts(tok, 300, trials=bad)


@pytest.mark.parametrize("tok", TOKENIZERS, ids=TOK_IDS)
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_key_at_requested_depth(tok, depth: float) -> None:
    p = build_passkey_prompt(tok, 1200, seed=7, depth=depth)
    before, total = _filler_fraction_before_key(p)
    assert total >= 4
    assert abs(before - depth * total) <= 1.0

    # Character-position fraction of the key inside the filler region.
    m = KEY_RE.search(p.text)
    region_start = len(INTRO) + 1
    region_end = len(p.text) - len(QUESTION) - 1
    filler_chars = region_end - region_start - len(m.group(0))
    frac_pos = (m.start() - region_start) * 1.0
    assert abs(frac_pos - depth * filler_chars) <= len(FILLER) + 2


def test_key_token_start_word_tokenizer() -> None:
    tok = WordTokenizer()
    for depth in (0.0, 0.3, 1.0):
        p = build_passkey_prompt(tok, 700, seed=2, depth=depth)
        words = ["<bos>"] + p.text.split()
        assert words[p.key_token_start : p.key_token_start + 5] == [
            "The", "pass", "key", "is", f"{p.passkey}."
        ]


def test_key_token_start_ignores_trailing_eos() -> None:
    tok = CharCallTokenizer()
    p = build_passkey_prompt(tok, 900, seed=4, depth=0.5)
    m = KEY_RE.search(p.text)
    assert p.key_token_start == m.start()


@pytest.mark.parametrize("tok", TOKENIZERS, ids=TOK_IDS)
@pytest.mark.parametrize("length", [120, 257, 1000, 2048, 4096])
def test_length_respected(tok, length: int) -> None:
    if length == 120 and not isinstance(tok, WordTokenizer):  # the fixed parts alone: over 120 tokens of 1-2 chars
        with pytest.raises(ValueError, match="too small"):
            build_passkey_prompt(tok, length, seed=length, depth=0.4)
        return
    p = build_passkey_prompt(tok, length, seed=length, depth=0.4)
    assert p.n_tokens == count_tokens(tok, p.text)
    assert p.n_tokens <= length
    assert p.n_tokens >= length - _unit_tokens(tok)


@pytest.mark.parametrize("tok", TOKENIZERS, ids=TOK_IDS)
def test_length_too_small_rejected(tok) -> None:
    with pytest.raises(ValueError, match="too small"):
        build_passkey_prompt(tok, 20, seed=0, depth=0.5)
    with pytest.raises(ValueError, match="length"):
        build_passkey_prompt(tok, 0, seed=0)


def test_minimum_length_fits_without_filler() -> None:
    tok = WordTokenizer()
    # The smallest length that fits is exactly the filler-free prompt.
    lo = 1
    hi = 200
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            build_passkey_prompt(tok, mid, seed=1, depth=0.5)
            hi = mid
        except ValueError:
            lo = mid
    p = build_passkey_prompt(tok, hi, seed=1, depth=0.5)
    assert FILLER not in p.text
    assert p.n_tokens == hi


@pytest.mark.parametrize("depth", [-0.1, 1.5, float("nan"), "deep"])
def test_bad_depth_rejected(depth) -> None:
    with pytest.raises(ValueError, match=r"depth"):
        build_passkey_prompt(WordTokenizer(), 500, seed=0, depth=depth)


def test_unsupported_tokenizer() -> None:
    with pytest.raises(TypeError, match="encode"):
        build_passkey_prompt(object(), 500, seed=0, depth=0.5)


@pytest.mark.parametrize(
    "text, key, ok",
    [
        ("12345.", "12345", True),
        (" 12345 is the pass key", "12345", True),
        ("\n12345", "12345", True),
        ("1234", "12345", False),
        ("12346", "12345", False),
        ("123456", "12345", False),
        ("no digits here", "12345", False),
        ("", "12345", False),
        ("99999 then 12345", "12345", False),
    ],
)
def test_score_passkey(text: str, key: str, ok: bool) -> None:
    assert score_passkey(text, key) is ok


def test_run_passkey_and_table() -> None:
    tok = WordTokenizer()
    prompts = {n: build_passkey_prompts(tok, n, trials=4, seed=0) for n in (300, 600)}
    calls: list[tuple[str, int]] = []

    def generate_fn(method: str, prompt: PasskeyPrompt) -> str:
        calls.append((method, prompt.seed))
        if method == "fp16":
            return f" {prompt.passkey}. Remember it."
        return " 00000."

    results = run_passkey(prompts, ["fp16", "broken-2bit"], generate_fn, progress=False)
    assert len(calls) == 2 * 2 * 4
    assert all(isinstance(r, PasskeyResult) for r in results)
    acc = {(r.method, r.length): r.accuracy for r in results}
    assert acc == {
        ("fp16", 300): 1.0,
        ("fp16", 600): 1.0,
        ("broken-2bit", 300): 0.0,
        ("broken-2bit", 600): 0.0,
    }
    assert all(r.trials == 4 for r in results)
    assert sum(r.correct for r in results) == 8

    table = format_passkey_table(results)
    for token in ("fp16", "broken-2bit", "300", "600", "1.00", "0.00", "4 trials"):
        assert token in table
    lines = table.splitlines()
    assert any(line.startswith("fp16") and line.count("1.00") == 2 for line in lines)


def test_run_passkey_progress_bar_and_empty(capsys) -> None:
    tok = WordTokenizer()
    prompts = {300: build_passkey_prompts(tok, 300, trials=2, seed=0)}
    res = run_passkey(prompts, ["m"], lambda m, p: p.passkey, progress=True)
    assert res[0].accuracy == 1.0
    with pytest.raises(ValueError, match="no prompts"):
        run_passkey({300: []}, ["m"], lambda m, p: "", progress=False)


def test_table_mixed_trial_counts() -> None:
    results = [
        PasskeyResult("a", 2048, 0.9, 10, 9),
        PasskeyResult("a", 4096, 0.5, 4, 2),
        PasskeyResult("b", 2048, 1.0, 10, 10),
    ]
    table = format_passkey_table(results)
    assert "2048 (n=10)" in table and "4096 (n=4)" in table
    assert "0.90" in table and "0.50" in table
    row_b = next(line for line in table.splitlines() if line.split()[:1] == ["b"])
    assert row_b.split()[-1] == "-"  # b has no 4096 trials

