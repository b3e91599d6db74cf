"""Files of JSON records appended one line at a time by the long runs (RULER's answers, perplexity windows,
timing records), read back so that a run stopped in the middle of a line resumes where it was.

A run killed while appending leaves its last line cut short. The process that appends to the file (`repair`)
drops that half line, with a warning, so its next record starts a line of its own, and gives a whole last line
without its newline one; a reader alone (a summary beside a run that may be appending at this moment) skips such
a line and leaves the file as it is. A bad line anywhere else is refused with its line number: it is not a
cut-short append, and skipping it would lose a record without a word.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path


class RecordError(ValueError):
    """A line of a records file that is not a JSON record and not the cut-short last line of an append."""


def read_jsonl(path: str | Path, repair: bool = True, dropped: str = "dropped", skipped: str = "skipped"
               ) -> list[tuple[int, dict]]:
    """(line number, record) of every record of `path`, in file order; none where the file is missing.

    `repair`: this process appends to the file (see the module docstring); `dropped` / `skipped` end the warning
    about a cut-short last line (what the caller does about the record it lost)."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except ValueError:
            if n == len(lines) and not text.endswith("\n"):
                warnings.warn(f"{path}:{n} was cut short (a run stopped while appending it, or one is appending it "
                              f"now): {dropped if repair else skipped}", stacklevel=2)
                if repair:
                    path.write_text(text[:len(text) - len(line)])
                return out
            raise RecordError(f"{path}:{n} is not a JSON record; remove that line or give another file") from None
    if repair and text and not text.endswith("\n"):  # a whole last record without its newline
        with path.open("a") as f:
            f.write("\n")
    return out
