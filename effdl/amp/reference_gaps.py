"""How far each training run of a precision comparison ends from the reference setup's run, and
whether that is within the run-to-run noise the reference's own reruns (other init seeds) show."""

from __future__ import annotations

import math

import numpy as np


def curve_gap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |a - b| over the steps both runs completed (NaN if one diverged at once)."""
    n = min(len(a), len(b))
    return float(np.mean(np.abs(a[:n] - b[:n]))) if n else float("nan")


def add_reference_gaps(runs: list[dict], reference: str) -> None:
    """Add to each run (a dict with ``setup``, ``role``, ``curve``, ``heldout_loss``) its gaps to
    the ``reference`` setup's main run and the noise they are judged against.

    ``noise_*`` are the largest gaps between the reference and its reruns: a run whose gaps are
    no larger is ``within_noise``. Without a main reference run nothing is added.
    """
    ref = next((r for r in runs if r["setup"] == reference and r["role"] == "main"), None)
    if ref is None:
        return
    noise = [r for r in runs if r["setup"] == reference and r["role"] == "rerun"]
    noise_curve = max((curve_gap(r["curve"], ref["curve"]) for r in noise), default=math.nan)
    noise_loss = max(
        (abs(r["heldout_loss"] - ref["heldout_loss"]) for r in noise), default=math.nan
    )
    for r in runs:
        r["curve_gap_to_reference"] = curve_gap(r["curve"], ref["curve"])
        r["heldout_loss_gap_to_reference"] = abs(r["heldout_loss"] - ref["heldout_loss"])
        r["noise_curve_gap"], r["noise_heldout_loss_gap"] = noise_curve, noise_loss
        r["within_noise"] = (
            r["curve_gap_to_reference"] <= noise_curve
            and r["heldout_loss_gap_to_reference"] <= noise_loss
        )
