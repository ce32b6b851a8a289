"""The shared learning-rate schedule against values worked out by hand."""

import math

import pytest

from effdl.optim import warmup_cosine_lr


def test_warmup_then_cosine_by_hand():
    lr = lambda s: warmup_cosine_lr(s, 1.0, 0.1, warmup=4, steps=14)  # noqa: E731
    assert [lr(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # cosine over steps 4..13 (span 9): the peak at step 4, the floor at the last step
    assert lr(4) == pytest.approx(1.0)
    assert lr(13) == pytest.approx(0.1)
    assert lr(7) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 3 / 9)))
    assert lr(20) == pytest.approx(0.1)  # past the last step: the floor
    assert warmup_cosine_lr(0, 1.0, 0.1, warmup=0, steps=1) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(steps=0), dict(warmup=-1), dict(step=-1), dict(lr=float("nan")), dict(min_lr=2.0)],
)
def test_a_schedule_that_cannot_be_followed_is_refused(kwargs):
    args = dict(step=0, lr=1.0, min_lr=0.1, warmup=2, steps=10) | kwargs
    with pytest.raises(ValueError, match="need"):
        warmup_cosine_lr(**args)
