import numpy as np
import pytest

from effdl.data.pipelines import make_loader
from effdl.data.tokenize import TokenizedCorpus


@pytest.mark.parametrize(
    ("pipeline", "k"),
    [("brain", 0), ("bigbrain", 0), ("ultra", 2), ("packed_concat", 0), ("packed_bfd", 0)],
)
def test_make_loader_covers_every_token_once(pipeline, k):
    seqs = [list(range(1, n + 1)) for n in np.random.default_rng(5).integers(1, 12, 60)]
    corpus = TokenizedCorpus.from_sequences(seqs)
    batches = list(make_loader(pipeline, corpus, 8, k=k, max_length=12))
    assert sum(b.n_real_tokens for b in batches) == sum(map(len, seqs))
    widths = {b.input_ids.shape[1] for b in batches}
    if pipeline in ("brain", "packed_concat", "packed_bfd"):
        assert widths == {12}
    else:
        assert all(b.input_ids.shape[1] == int(b.lengths.max()) for b in batches)
    with pytest.raises(ValueError, match="pipeline"):
        make_loader("huge", corpus, 8)


def test_token_budget_and_open_row_count_are_ultra_only():
    corpus = TokenizedCorpus.from_sequences([[1, 2], [3]])
    with pytest.raises(ValueError, match="only to pipeline 'ultra'"):
        make_loader("bigbrain", corpus, 8, max_tokens=64)
    with pytest.raises(ValueError, match="only to pipeline 'ultra'"):
        make_loader("brain", corpus, None)


def test_make_loader_ultra_token_budget_covers_every_token_once():
    seqs = [list(range(1, n + 1)) for n in np.random.default_rng(9).integers(1, 12, 60)]
    corpus = TokenizedCorpus.from_sequences(seqs)
    batches = list(make_loader("ultra", corpus, None, k=2, max_length=12, max_tokens=40))
    assert sum(b.n_real_tokens for b in batches) == sum(map(len, seqs))
    assert all(b.input_ids.numel() <= 40 or b.input_ids.shape[0] == 1 for b in batches)
