"""Plain-text tables of dict rows, for the summaries scripts and profiles print, and the wording
of values in the report notebooks: a missing value reads "not measured" (never "nan" or "None",
and no verdict beside it), a column with no value is named once instead of shown, a signed
difference names its direction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

NOT_MEASURED = "-"
MISSING = "not measured"


def is_missing(value: Any) -> bool:
    """True for None, NaN and pandas' NA: a quantity the logs do not hold."""
    if value is None or type(value).__name__ == "NAType":
        return True
    try:
        return math.isnan(value)
    except (TypeError, ValueError):
        return False


def measured(value: Any, spec: str = ".3g", unit: str = "", missing: str = MISSING) -> str:
    """``value`` formatted by ``spec`` (followed by ``unit``), or ``missing`` where it is None or
    NaN: ``measured(None, ".1f", " GiB")`` reads "not measured", not "nan GiB"."""
    return missing if is_missing(value) else format(value, spec) + unit


def signed_gap(difference: float, positive: str, negative: str, spec: str = ".2f") -> str:
    """A difference as its size and the word for its sign: ``signed_gap(x - y, "below",
    "above")`` reads "0.63 below" for 0.63 and "0.63 above" for -0.63, never "-0.63 below"."""
    if is_missing(difference):
        return MISSING
    return f"{format(abs(difference), spec)} {positive if difference >= 0 else negative}"


def split_unmeasured(frame: Any) -> tuple[Any, list]:
    """A pandas DataFrame without its columns that hold no value at all, and those columns'
    names: a report shows the measured columns and names the others once as not measured,
    instead of a column of "NaN"."""
    empty = [c for c in frame.columns if frame[c].isna().all()]
    return frame.drop(columns=empty), empty


def missing_as_text(frame: Any, text: str = MISSING, spec: str | None = None) -> Any:
    """A copy of a pandas DataFrame (or Series) for display: its missing cells (None, NaN)
    written as ``text`` instead of "NaN" / "None", and, with ``spec`` (".3f"), its floats
    formatted by it (as a float column would show them)."""

    def cell(value: Any) -> Any:
        if is_missing(value):
            return text
        return format(value, spec) if spec and isinstance(value, float) else value

    if hasattr(frame, "columns"):  # column by column: DataFrame.map needs pandas >= 2.1
        return frame.apply(lambda column: column.map(cell))
    return frame.map(cell)


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


def spread(rows: Sequence[Mapping[str, Any]], by: str, fields: Sequence[str]) -> list[dict]:
    """Per value of ``by`` (first-seen order): the number of rows and, for each of ``fields``,
    the mean, min and max over the rows where it was measured (see :func:`is_missing`), None
    where no row measured it. The spread of repeated runs, such as one setup under several
    seeds."""
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r[by], []).append(r)
    out = []
    for key, members in groups.items():
        row: dict[str, Any] = {by: key, "n": len(members)}
        for f in fields:
            values = [float(m[f]) for m in members if not is_missing(m.get(f))]
            row[f"{f}_mean"] = sum(values) / len(values) if values else None
            row[f"{f}_min"] = min(values, default=None)
            row[f"{f}_max"] = max(values, default=None)
        out.append(row)
    return out
