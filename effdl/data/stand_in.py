"""Generated stand-ins beside the real data sets: the table the reports show.

``tools/stand_in_data.py`` logs one record per (data set, statistic): ``config`` names the data
set (``source``, as the runs' own logs name it), the statistic, its ``unit`` and where the
published figure comes from (``published_note``); ``metrics`` holds ``measured`` and
``published`` (None where the real set's figure is not published).
"""

from __future__ import annotations

import pandas as pd

NOT_PUBLISHED = "not published"
UNITS = ("count", "tokens", "px", "share", "megapixels")


def _format(value: float | None, unit: str) -> str:
    if value is None or pd.isna(value):
        return ""
    if unit == "share":
        return f"{value:.2%}"
    if float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.2f}" if unit == "megapixels" else f"{value:,.1f}"


def newest_run(records: pd.DataFrame) -> pd.DataFrame:
    """The records of the newest run (``env.run_id``) among flattened records
    (:func:`effdl.results.load_results`)."""
    newest = records.sort_values("env.time")["env.run_id"].iloc[-1]
    return records[records["env.run_id"] == newest]


def stand_in_values(records: pd.DataFrame) -> pd.DataFrame:
    """``measured`` and ``published`` of the newest run, indexed by the statistic's key (the
    variant after ``<data set>/``)."""
    rows = newest_run(records)
    return pd.DataFrame(
        {
            "measured": pd.to_numeric(rows["metrics.measured"]).to_numpy(),
            "published": pd.to_numeric(rows["metrics.published"], errors="coerce").to_numpy(),
        },
        index=pd.Index(rows["variant"].str.partition("/")[2], name="key"),
    )


def stand_in_table(records: pd.DataFrame) -> pd.DataFrame:
    """Measured against published, one row per statistic, from flattened records of one data
    set; only the newest run is shown. Columns: the stand-in's value, the real set's, their
    ratio, and where the real figure comes from (or that it is not published)."""
    rows = newest_run(records)
    measured = rows["metrics.measured"].astype(float)
    published = pd.to_numeric(rows["metrics.published"], errors="coerce")
    units = rows["config.unit"]
    table = pd.DataFrame({
        "statistic": rows["config.statistic"],
        "stand-in": [_format(v, u) for v, u in zip(measured, units, strict=True)],
        "real set": [_format(v, u) for v, u in zip(published, units, strict=True)],
        "stand-in / real": [f"{r:.3g}" if pd.notna(r) else "" for r in measured / published],
        "real figure": rows["config.published_note"],
    })  # fmt: skip
    return table.set_index("statistic")
