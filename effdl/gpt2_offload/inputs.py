"""What a GPT-2 offload run trains: the model (random init or a checked local folder, the same
weights for every run of one invocation), the batches of each step (cut in order from a stream,
or drawn from its windows pass by pass), and the learning rates."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import torch

from effdl.cli import UsageError
from effdl.data.corpus import CorpusFormatError, read_wikitext
from effdl.data.stdlib_text import stdlib_training_text
from effdl.data.token_streams import step_batches, synthetic_stream, text_stream
from effdl.gpt2_offload.config import TrainConfig
from effdl.models.gpt2 import ModelFolderError, check_model_folder, load_gpt2
from effdl.optim import warmup_cosine_lr


def model_folder_config(model_path: Path | None, size: str, seq: int):
    """The ``GPT2Config`` of ``--model-path`` (None without one), checked by
    :func:`effdl.models.gpt2.check_model_folder` against ``--size`` and ``--seq``; a
    :class:`UsageError` in one line otherwise."""
    if model_path is None:
        return None
    try:
        config = check_model_folder(model_path, size)
    except ModelFolderError as e:
        raise UsageError(f"--model-path: {e}") from None
    if seq > config.n_positions:
        raise UsageError(
            f"--seq {seq} exceeds the {config.n_positions} positions of {model_path}/config.json"
        )
    return config


def load_model(
    size: str, model_path: Path | None, dropout: float, fast_gelu: bool = True
) -> torch.nn.Module:
    """:func:`effdl.models.gpt2.load_gpt2`, with a weight file that does not load reported as
    a one-line :class:`UsageError` naming ``--model-path``."""
    try:
        return load_gpt2(size, model_path, dropout=dropout, fast_gelu=fast_gelu)
    except ModelFolderError as e:
        raise UsageError(f"--model-path: {e}") from None


def initial_model(cfg: TrainConfig, seed: int, fast_gelu: bool = True) -> torch.nn.Module:
    """:func:`load_model` of ``cfg`` with the torch seed set to ``seed`` first: every run of
    one invocation (ours, the reference, a peer) starts from the same weights."""
    torch.manual_seed(seed)
    return load_model(cfg.size, cfg.model_path, cfg.dropout, fast_gelu)


def model_tokenizer(cfg: TrainConfig) -> str:
    """What :func:`text_stream` tokenizes with, given ``--model-path`` (or none): the folder's
    ``tokenizer.json``, else the UTF-8 bytes."""
    folder = cfg.model_path
    return str(folder) if folder and (folder / "tokenizer.json").is_file() else "utf-8 bytes"


def make_batches(
    cfg: TrainConfig, vocab: int, seed: int
) -> tuple[list[torch.Tensor], dict[str, str]]:
    """One (batch, seq) int64 tensor per step (the same one with --fixed-batch), and the names
    of the data and tokenizer for the records: the stdlib corpus by default
    (:func:`effdl.data.stdlib_text.stdlib_training_text`: with ``--model-path``, read by the
    folder's tokenizer, ``<bos>`` kept between documents when it has that token), the synthetic
    stream for ``--data generated``, else ``--data`` read as the other scripts read it (checked
    in full)."""
    if cfg.data is None:
        try:
            text = stdlib_training_text(cfg.cache, cfg.bpe_vocab, cfg.corpus_bytes, cfg.model_path)
        except CorpusFormatError as e:  # the folder's tokenizer.json does not load
            raise UsageError(f"--model-path: {e}") from None
        tokenizer = model_tokenizer(cfg) if cfg.model_path else text.tokenizer_dir.name
        names = {"data": text.name, "tokenizer": tokenizer}
        stream = functools.partial(
            text_stream, text.docs, vocab=vocab, tokenizer_dir=text.tokenizer_dir,
            source=text.name, bos_id=text.bos_id,
        )  # fmt: skip
    elif cfg.synthetic:
        stream = functools.partial(synthetic_stream, vocab=vocab, seed=seed)
        names = {"data": "synthetic", "tokenizer": "none"}
    else:
        try:
            lines = read_wikitext(cfg.data)
        except CorpusFormatError as e:
            raise UsageError(f"--data: {e}") from None
        if not lines:
            raise UsageError(f"--data: {cfg.data} holds no non-empty text")
        stream = functools.partial(
            text_stream, lines, vocab=vocab, tokenizer_dir=cfg.model_path, source=cfg.data
        )
        names = {"data": str(cfg.data), "tokenizer": model_tokenizer(cfg)}
    try:
        batches = step_batches(stream, cfg.steps, cfg.batch, cfg.seq, fixed=cfg.fixed_batch)
    except CorpusFormatError as e:
        raise UsageError(f"--data: {e}") from None
    return batches, names


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of ``step`` (0-based): ``lr * (step + 1) / warmup_steps`` during the
    warm-up, then ``lr`` (constant) or a cosine from ``lr`` down to ``lr / 10`` at the last step."""
    if cfg.lr_schedule == "constant" and step >= cfg.warmup_steps:
        return cfg.lr
    return warmup_cosine_lr(step, cfg.lr, cfg.lr / 10, cfg.warmup_steps, cfg.steps)


def set_lr(opt, lr: float) -> None:
    """Give every parameter group of ``opt`` the learning rate ``lr``."""
    for group in opt.param_groups:
        group["lr"] = lr


def token_windows(tokens: torch.Tensor, seq: int) -> torch.Tensor:
    """``tokens`` (1-d) cut into ``(n, seq)`` rows in order, the remainder dropped."""
    return tokens[: len(tokens) // seq * seq].view(-1, seq)


def step_windows(windows: torch.Tensor, batch: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless ``(batch, seq)`` batches of ``windows``' rows: each pass over them in a fresh
    random order drawn from ``seed`` (a batch may straddle two passes)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    while True:
        while len(order) < batch:
            order = torch.cat([order, torch.randperm(len(windows), generator=g)])
        yield windows[order[:batch]]
        order = order[batch:]
