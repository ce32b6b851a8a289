"""effdl.parallel.classifiers: the shared batch order, the equal-work MLP, the level models, and
the training record, against hand-made expectations."""

import pytest
import torch

from effdl.parallel.classifiers import (
    LEVELS,
    TrainResult,
    epoch_batches,
    equal_work_mlp,
    level_model,
)
from effdl.profiling.timing import TimingStats


def test_epoch_batches_are_seeded_permutations_epoch_after_epoch():
    batches = epoch_batches(10, 4, 5, seed=3)
    assert len(batches) == 5 and all(b.shape == (4,) for b in batches)
    rows = torch.cat(batches).tolist()
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))
    again = epoch_batches(10, 4, 5, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    longer = epoch_batches(10, 4, 9, seed=3)  # more steps: the same first steps
    assert all(torch.equal(a, b) for a, b in zip(batches, longer, strict=False))


def test_equal_work_mlp_has_a_block_per_piece_and_classifies():
    model = equal_work_mlp(features=12, hidden=16, classes=10, pieces=3)
    assert len(model) == 3
    assert model(torch.randn(5, 12)).shape == (5, 10)


@pytest.mark.parametrize("level", LEVELS)
def test_level_models_map_images_to_ten_logits_from_the_seed(level):
    kwargs = {"hidden": 16, "d_model": 8, "heads": 2, "activation": "gelu",
              "dtype": torch.float64, "seed": 1}  # fmt: skip
    a, b = level_model(level, (1, 8, 8), **kwargs), level_model(level, (1, 8, 8), **kwargs)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    assert a(x).shape == (3, 10)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_train_result_metrics_and_gap():
    stats = TimingStats.from_times([0.001, 0.003])
    result = TrainResult([2.0, 1.0], 0.5, stats)
    m = result.metrics()
    assert m["final_loss"] == 1.0 and m["timed_steps"] == 2
    assert m["step_ms_median"] == pytest.approx(2.0)
    assert result.max_relative_gap(TrainResult([2.0, 0.8], 0.5, stats)) == pytest.approx(0.25)
