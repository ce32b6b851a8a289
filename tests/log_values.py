"""What a run log's results may not hold: numbers that are not finite, whether written as JSON's
NaN/Infinity or as the strings effdl.results writes for them ("nan", "inf", "-inf")."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def non_finite(value: Any, where: str = "") -> dict[str, Any]:
    """Every non-finite number in ``value`` (nested mappings and lists too), by its path
    (``loss``, ``curve[3]``, ``split.forward``): floats that are NaN or infinite, and strings
    that read as one (``"nan"``, ``"NaN"``, ``"inf"``, ``"-inf"``, ``"Infinity"``)."""
    found: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            found |= non_finite(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found |= non_finite(item, f"{where}[{i}]")
    elif _is_non_finite(value):
        found[where] = value
    return found


def _is_non_finite(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False  # not a number at all
    return isinstance(value, float) and not math.isfinite(value)


def non_finite_in_last_record(log: Path) -> dict[str, Any]:
    """The non-finite numbers among the metrics of ``log``'s last record, as written."""
    last = log.read_text().splitlines()[-1]
    return non_finite(json.loads(last)["metrics"])  # json reads NaN and Infinity as floats
