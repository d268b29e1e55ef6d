"""The one table printer of tpassctl: a header row, columns two spaces apart.

Plain str.ljust/rjust: every node's root venv has tpassctl, and a table
library there would be one more dependency to install and audit for this.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

MISSING = "-"


def cell(value: Any) -> str:
    return MISSING if value is None or value == "" else str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[str] = ()) -> list[str]:
    """The lines of a table: ``headers`` first, then one line per row (None shows as "-").
    Columns named in ``right`` are right-aligned (numbers); the last column is not padded."""
    body = [[cell(v) for v in row] for row in rows]
    for row in body:
        if len(row) != len(headers):
            raise ValueError(f"a row of {len(row)} cells under {len(headers)} headers: {row}")
    widths = [max([len(h), *(len(r[i]) for r in body)]) for i, h in enumerate(headers)]
    right = set(right)
    out = []
    for row in [list(headers), *body]:
        cells = [(c.rjust(w) if h in right else c.ljust(w)) for c, w, h in zip(row, widths, headers)]
        if headers[-1] not in right:
            cells[-1] = row[-1]
        out.append("  ".join(cells).rstrip())
    return out


__all__ = ["table"]
