import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from effdl.data.packing import packed_loader
from effdl.data.padding import PadCollator, UnpaddedDataset
from effdl.data.tokenize import TokenizedCorpus
from effdl.models.gpt_like import GPTLikeConfig, GPTLikeModel
from effdl.models.lm_objective import lm_inputs
from effdl.profiling.epoch import EpochTiming, time_epoch

CPU = torch.device("cpu")


def corpus(n=23, seed=0):
    rng = np.random.default_rng(seed)
    return TokenizedCorpus.from_sequences(
        rng.integers(2, 50, int(rng.integers(1, 30))) for _ in range(n)
    )


def padded_loader(c, batch_size=4):
    return DataLoader(UnpaddedDataset(c), batch_size=batch_size, collate_fn=PadCollator(0))


def tiny_model():
    torch.manual_seed(0)
    cfg = GPTLikeConfig(50, d_model=16, n_heads=2, d_ff=32, max_length=32, dropout=0.0)
    return GPTLikeModel(cfg).eval()


class CountingForward:
    """``model.features`` that records the width of every batch it runs."""

    def __init__(self, model):
        self.model, self.widths = model, []

    def __call__(self, **kwargs):
        self.widths.append(kwargs["input_ids"].shape[1])
        assert not torch.is_grad_enabled()  # forward-only
        return self.model.features(**kwargs)


def brute_force(loader, max_batches=None):
    """Real tokens, slots and widths of the first ``max_batches`` batches, read directly."""
    real = slots = 0
    widths = []
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        ids = batch.input_ids
        real += (
            int((batch.doc_ids >= 0).sum())
            if hasattr(batch, "doc_ids")
            else int(batch.lengths.sum())
        )
        slots += ids.numel()
        widths.append(ids.shape[1])
    return real, slots, widths


@pytest.mark.parametrize("max_batches", [None, 2])
@pytest.mark.parametrize("kind", ["padded", "packed"])
def test_counts_equal_brute_force(kind, max_batches):
    c = corpus()
    if kind == "padded":
        loader = padded_loader(c)
    else:
        loader = packed_loader([c[i] for i in range(len(c))], 32, 3, pad_id=0, method="bfd")
    forward = CountingForward(tiny_model())
    timing = time_epoch(
        forward, loader, CPU, inputs_of=lm_inputs, max_batches=max_batches, warmup_batches=0
    )
    real, slots, widths = brute_force(loader, max_batches)
    assert (timing.real_tokens, timing.slots, timing.widths) == (real, slots, widths)
    assert timing.n_batches == len(widths) == len(timing.batch_s)
    assert timing.padding_fraction == pytest.approx(1 - real / slots)
    if kind == "padded":
        assert timing.real_tokens == (c.n_tokens if max_batches is None else real)


@pytest.mark.parametrize(("warmup", "max_batches"), [(0, None), (2, 3), (10, 9)])
def test_timed_batches_honour_warmup_and_max_batches(warmup, max_batches):
    loader = padded_loader(corpus(n=14))  # 4 batches, the last one short
    forward = CountingForward(tiny_model())
    timing = time_epoch(
        forward, loader, CPU, inputs_of=lm_inputs, max_batches=max_batches, warmup_batches=warmup
    )
    n_timed = len(loader) if max_batches is None else min(max_batches, len(loader))
    n_warm = min(warmup, len(loader))
    widths = brute_force(loader)[2]
    assert timing.n_batches == n_timed
    # The warm-up runs the first batches, then the timed pass starts again from batch 0.
    assert forward.widths == widths[:n_warm] + widths[:n_timed]
    assert timing.widths == widths[:n_timed]


def test_host_split_is_non_negative_and_within_the_epoch():
    timing = time_epoch(
        CountingForward(tiny_model()), padded_loader(corpus()), CPU, inputs_of=lm_inputs
    )
    split = timing.host_split()
    assert set(split) == {"first_batch_s", "wait_s", "launch_s"}
    assert all(v >= 0 for v in split.values())
    assert all(t > 0 for t in timing.batch_s)
    # The waits, the launches (each holding its forward on CPU) and the gaps between them
    # make up the epoch's wall time.
    assert sum(split.values()) <= timing.epoch_s
    assert timing.compute_s <= timing.launch_s  # on CPU a forward's time lies inside its launch
    assert timing.peak_mem_gib is None  # no allocator statistics on CPU: not measured


def test_empty_loader_is_an_error():
    with pytest.raises(ValueError, match="no batch"):
        time_epoch(CountingForward(tiny_model()), [], CPU, inputs_of=lm_inputs)


def test_epoch_timing_derived_fields():
    t = EpochTiming([0.5, 0.25], 2.0, 30, 40, [10, 10], None, 0.1, 0.2, 0.9)
    assert (t.n_batches, t.compute_s, t.padding_fraction) == (2, 0.75, 0.25)
