"""Plain-text tables for the terminal: the one formatter of the `kvsqueeze` commands."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[int] = (0,),
               rule: bool = True, title: str | None = None) -> str:
    """Columns padded to their widest cell, two spaces apart.

    Args:
        header: column names; rows: cells already formatted as strings.
        left: indices of the left-aligned (text) columns; the others, numbers, are right-aligned.
        rule: a line of dashes under the header.
        title: a line above the table.
    """
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = ([title] if title else []) + [line(header)] + (["  ".join("-" * w for w in widths)] if rule else [])
    return "\n".join(lines + [line(r) for r in rows])
