"""Plain-text tables of dict rows, for the summaries scripts and profiles print."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NOT_MEASURED = "-"


def format_measured(value: float | None, spec: str = ".3f") -> str:
    """``value`` formatted by ``spec``, or :data:`NOT_MEASURED` where it is None (a quantity
    this device cannot measure, such as peak GPU memory on the CPU)."""
    return NOT_MEASURED if value is None else format(value, spec)


def format_table(rows: Sequence[Mapping[str, Any]], floatfmt: str = ".4g") -> str:
    """Plain-text table of dict rows (columns from the union of keys, first-seen order)."""
    if not rows:
        return "(no rows)"
    cols: list[str] = []
    for r in rows:
        cols.extend(k for k in r if k not in cols)

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return format(v, floatfmt)
        return "" if v is None else str(v)

    body = [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths]), *map(line, body)])
