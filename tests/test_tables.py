import math

import pandas as pd

from effdl.tables import (
    MISSING,
    is_missing,
    measured,
    missing_as_text,
    signed_gap,
    split_unmeasured,
    spread,
)


def test_missing_values_read_not_measured_never_nan_or_none():
    for value in (None, float("nan"), pd.NA):
        assert is_missing(value)
        assert measured(value, ".1f", " GiB") == MISSING
    assert not is_missing(0.0) and not is_missing("text") and not is_missing(False)
    assert measured(10.116, ".1f", " GiB") == "10.1 GiB"


def test_signed_gap_names_the_direction_instead_of_a_minus_sign():
    assert signed_gap(1.6, "below", "above") == "1.60 below"
    assert signed_gap(-0.63, "below", "above") == "0.63 above"
    assert signed_gap(0.0, "below", "above") == "0.00 below"
    assert signed_gap(math.nan, "below", "above") == MISSING


def test_missing_as_text_fills_only_missing_cells():
    df = pd.DataFrame({"a": [1.23456, math.nan], "b": [None, "x"], "n": [3, 4]})
    shown = missing_as_text(df, spec=".2f")
    assert shown.loc[0, "a"] == "1.23" and shown.loc[1, "a"] == MISSING
    assert shown.loc[0, "b"] == MISSING and shown.loc[1, "b"] == "x"
    assert list(shown["n"]) == [3, 4]  # integers as they are
    assert "NaN" not in shown.to_string() and "None" not in shown.to_string()
    assert list(missing_as_text(pd.Series([0.5, None]))) == [0.5, MISSING]


def test_split_unmeasured_drops_only_columns_without_any_value():
    df = pd.DataFrame({"time": [1.0, 2.0], "peak": [math.nan, None], "ratio": [math.nan, 0.5]})
    shown, empty = split_unmeasured(df)
    assert list(shown.columns) == ["time", "ratio"] and empty == ["peak"]


def test_spread_over_repeats_skips_unmeasured_values():
    rows = [
        {"setup": "a", "loss": 2.0, "diverged": False},
        {"setup": "b", "loss": float("nan"), "diverged": True},
        {"setup": "a", "loss": 4.0, "diverged": True},
        {"setup": "a", "loss": None, "diverged": False},
    ]
    a, b = spread(rows, "setup", ("loss", "diverged"))
    assert a == {"setup": "a", "n": 3, "loss_mean": 3.0, "loss_min": 2.0, "loss_max": 4.0,
                 "diverged_mean": 1 / 3, "diverged_min": 0.0, "diverged_max": 1.0}  # fmt: skip
    assert b["n"] == 1 and b["loss_mean"] is b["loss_min"] is b["loss_max"] is None
