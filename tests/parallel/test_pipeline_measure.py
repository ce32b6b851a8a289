"""effdl.parallel.pipeline_measure: the slowest rank's step time, and the predicted bubble
against the formula where the formula holds (equal stage times, free messages)."""

import pytest

from effdl.parallel.pipeline import bubble_fraction
from effdl.parallel.pipeline_measure import bubble_summary, predicted_bubble, slowest_rank_steps


def test_a_step_lasts_until_the_slowest_rank_is_done():
    ranks = [
        [{"step": 0, "loss": 2.0, "step_s": 0.1}, {"step": 1, "loss": 1.5, "step_s": 0.4}],
        [{"step": 0, "loss": 9.0, "step_s": 0.3}, {"step": 1, "loss": 9.0, "step_s": 0.2}],
    ]
    rows = slowest_rank_steps(ranks, loss_rank=0)
    assert rows == [
        {"step": 0, "loss": 2.0, "step_s": 0.3},
        {"step": 1, "loss": 1.5, "step_s": 0.4},
    ]


@pytest.mark.parametrize(("schedule", "chunks"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_equal_times_predict_the_formula_and_messages_add_to_it(schedule, chunks):
    times = [1.0] * 4, [2.0] * 4
    free = predicted_bubble(schedule, 8, chunks, *times)
    assert free == pytest.approx(bubble_fraction(4, 8, chunks))
    assert predicted_bubble(schedule, 8, chunks, *times, message_s=0.5) > free


def test_bubble_summary_measures_idle_share_per_step_and_rank():
    results = [
        {"busy_s": [0.6, 0.6], "wall_s": [1.0, 1.0], "forward_s": 1.0, "backward_s": 2.0,
         "message_s": 0.0},
        {"busy_s": [0.8, 0.8], "wall_s": [0.9, 1.0], "forward_s": 1.0, "backward_s": 2.0},
    ]  # fmt: skip
    out = bubble_summary("1f1b", 4, 1, results)
    assert out["bubble_measured"] == pytest.approx(0.3)
    assert out["bubble_measured_per_rank"] == pytest.approx([0.4, 0.2])
    assert out["bubble_formula"] == pytest.approx(bubble_fraction(2, 4))
    assert out["bubble_predicted"] == pytest.approx(out["bubble_formula"])
