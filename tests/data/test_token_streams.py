"""Token streams: the synthetic one is reproducible and learnable, text files tokenize as bytes
or with a local tokenizer, and per-step batches are cut in order."""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from effdl.data.corpus import CorpusFormatError, read_wikitext
from effdl.data.token_streams import (
    next_token_entropies,
    step_batches,
    synthetic_stream,
    text_stream,
)
from effdl.data.tokenize import tokenizer_token_id


def test_synthetic_stream_is_pinned() -> None:
    """The report re-derives the fixed batch's statistics from (n_tokens, vocab, seed)."""
    x = synthetic_stream(10_000, 50257, 0)
    assert x.shape == (10_000,) and x.dtype == torch.int64
    assert x[:8].tolist() == [26671, 38484, 16159, 8094, 30261, 43116, 13676, 9026]
    assert int(x.sum()) == 248_302_324
    assert torch.equal(synthetic_stream(512, 64, 3), synthetic_stream(512, 64, 3))
    assert not torch.equal(synthetic_stream(512, 64, 3), synthetic_stream(512, 64, 4))


def test_synthetic_stream_is_learnable() -> None:
    """Inside a phrase the next token is determined: a bigram table from the first half of the
    stream predicts most next tokens of the second half (none of a uniform random stream)."""
    x = synthetic_stream(50_000, 50257, 0).tolist()
    train, held_out = x[:25_000], x[25_000:]
    successors: dict[int, Counter] = {}
    for a, b in itertools.pairwise(train):
        successors.setdefault(a, Counter())[b] += 1
    guess = {a: c.most_common(1)[0][0] for a, c in successors.items()}
    hits = sum(guess.get(a) == b for a, b in itertools.pairwise(held_out))
    assert hits / (len(held_out) - 1) > 0.75


def test_text_stream_raw_bytes(tmp_path: Path) -> None:
    path = tmp_path / "wiki.train.raw"
    path.write_text(" = Title = \n héllo\n", encoding="utf-8")
    tokens = text_stream(read_wikitext(path), 10, vocab=50257)
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == list(b" = Title = \n")[:10]  # lines as the reader gives them


def test_text_stream_with_local_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    lines = ["the cat sat", "the dog sat"]
    assert text_stream(lines, 5, vocab=4, tokenizer_dir=tmp_path).tolist() == [1, 2, 3, 1, 0]
    everything = text_stream(lines * 100, None, vocab=4, tokenizer_dir=tmp_path, bos_id=0)
    assert everything.tolist() == [0, 1, 2, 3, 0, 1, 0, 3] * 100  # all lines, in batches
    assert tokenizer_token_id(tmp_path, "cat") == 2
    assert tokenizer_token_id(tmp_path, "<bos>") is None
    assert tokenizer_token_id(tmp_path / "nowhere", "cat") is None  # bytes: no tokens


def test_text_stream_errors_name_the_source() -> None:
    with pytest.raises(CorpusFormatError, match=re.escape("short.txt gives 4 tokens, need 10")):
        text_stream(["abc"], 10, vocab=256, source="short.txt")
    with pytest.raises(
        CorpusFormatError, match=re.escape("short.txt gives token id 99 >= vocab 64")
    ):
        text_stream(["abc"], 3, vocab=64, source="short.txt")  # 'c' is byte 99


def test_step_batches_cut_in_order() -> None:
    asked = []

    def stream(n: int) -> torch.Tensor:
        asked.append(n)
        return torch.arange(n)

    batches = step_batches(stream, steps=3, batch=2, seq=4)
    assert asked == [24]
    assert [b.shape for b in batches] == [(2, 4)] * 3
    assert torch.equal(torch.cat([b.reshape(-1) for b in batches]), torch.arange(24))


def test_step_batches_fixed_repeats_the_first() -> None:
    batches = step_batches(torch.arange, steps=3, batch=2, seq=4, fixed=True)
    assert len(batches) == 3
    assert all(torch.equal(b, torch.arange(8).view(2, 4)) for b in batches)


def test_text_stream_puts_bos_before_every_line() -> None:
    tokens = text_stream(["ab", "c"], 5, vocab=256, bos_id=1)
    assert tokens.tolist() == [1, *b"ab\n", 1]


def test_next_token_entropies_match_counting_by_hand():
    """Brute force over the (previous, next) pairs of a random batch with repeats."""
    batch = torch.randint(0, 7, (5, 40), generator=torch.Generator().manual_seed(0))
    prev, target = batch[:, :-1].flatten().tolist(), batch[:, 1:].flatten().tolist()
    n = len(target)
    uni, pair, before = Counter(target), Counter(zip(prev, target, strict=True)), Counter(prev)
    unigram = -sum(c / n * math.log(c / n) for c in uni.values())
    bigram = -sum(c / n * math.log(c / before[a]) for (a, _), c in pair.items())
    got = next_token_entropies(batch)
    assert got["targets"] == n and got["distinct"] == len(uni)
    assert got["unigram"] == pytest.approx(unigram, rel=1e-12)
    assert got["bigram"] == pytest.approx(bigram, rel=1e-12)
    assert 0 <= got["bigram"] <= got["unigram"] <= math.log(7)


def test_next_token_entropies_need_rows_of_two_tokens():
    with pytest.raises(ValueError, match="length >= 2"):
        next_token_entropies(torch.tensor([[3], [4]]))
