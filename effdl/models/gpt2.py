"""GPT-2 (Hugging Face ``GPT2LMHeadModel``) built from its config, and what fits it in 11 GiB.

* :func:`gpt2_config` / :func:`build_gpt2`: GPT-2-Large is 36 layers, d=1280, 20 heads, vocab
  50257, 1024 positions: 774,030,080 parameters (the LM head is tied to the token embedding).
  Random init by default; pretrained weights only from a local folder. ``fast_gelu`` swaps
  HF's python ``gelu_new`` (eight elementwise kernels, four saved 4d-wide tensors) for
  ``gelu_pytorch_tanh``: the same tanh formula in one kernel (tests compare logits and grads).
* :func:`checkpoint_blocks`: activation checkpointing of the first ``n`` blocks (each keeps only
  its input and recomputes its forward in backward), so memory can be traded layer by layer.
* :func:`lm_loss`: the next-token loss through :func:`effdl.ops.chunked_lm_loss.chunked_lm_loss`,
  without the ``tokens x 50257`` logits.
* :func:`save_gpt2_folder`: a trained model as the local folder :func:`build_gpt2` loads, with
  its tokenizer beside it, written whole or not at all.
* :func:`check_model_folder`: a local folder's config and weight names checked before loading
  (:class:`ModelFolderError` for what ``from_pretrained`` would fail on or load wrongly).
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from effdl.ops.chunked_lm_loss import chunked_lm_loss

GPT2_LARGE_PARAMS = 774_030_080
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MODEL_FOLDER = (
    "a local Hugging Face GPT-2 folder: config.json + model.safetensors or pytorch_model.bin"
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")  # fmt: skip


class ModelFolderError(ValueError):
    """A model folder that cannot be loaded as the GPT-2 asked for; the message names the file."""


@dataclass(frozen=True)
class GPT2Shape:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    n_positions: int = 1024


SHAPES = {
    "large": GPT2Shape(n_layer=36, n_embd=1280, n_head=20),
    "xl": GPT2Shape(n_layer=48, n_embd=1600, n_head=25),
    "tiny": GPT2Shape(n_layer=2, n_embd=64, n_head=2),
}


def gpt2_config(size: str = "large", *, fast_gelu: bool = True, dropout: float = 0.1):
    """A ``transformers.GPT2Config`` for ``size`` in :data:`SHAPES` (SDPA attention)."""
    from transformers import GPT2Config

    if size not in SHAPES:
        raise ValueError(f"unknown GPT-2 size {size!r}; expected one of {sorted(SHAPES)}")
    s = SHAPES[size]
    return GPT2Config(
        n_layer=s.n_layer,
        n_embd=s.n_embd,
        n_head=s.n_head,
        vocab_size=s.vocab_size,
        n_positions=s.n_positions,
        activation_function="gelu_pytorch_tanh" if fast_gelu else "gelu_new",
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_gpt2(config=None, model_path: Path | None = None, *, fast_gelu: bool = True):
    """``GPT2LMHeadModel`` in fp32 on the CPU: random init from ``config`` (default: large),
    or local pretrained weights from ``model_path`` (never downloads)."""
    from transformers import GPT2LMHeadModel

    if model_path is not None:
        act = "gelu_pytorch_tanh" if fast_gelu else "gelu_new"
        model = GPT2LMHeadModel.from_pretrained(
            model_path,
            local_files_only=True,
            torch_dtype=torch.float32,
            activation_function=act,
            attn_implementation="sdpa",
            use_cache=False,
        )
        return _detached_from_file(model)
    return GPT2LMHeadModel(config if config is not None else gpt2_config("large"))


def _detached_from_file(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every tensor copied out of the weight file's memory map.

    ``from_pretrained`` maps the file and reads it lazily; the pages it reads stay in the
    process's resident set as long as the map lives, beside the copies an offloaded run makes of
    the same weights, so the host cap would count them twice. Copied, the map is released.
    """
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    return model


def load_gpt2(
    size: str, model_path: Path | None = None, *, dropout: float = 0.0, fast_gelu: bool = True
) -> torch.nn.Module:
    """The GPT-2 to train, fp32 on the CPU: random init of ``size`` (drawn from the torch seed of
    the moment), or ``model_path``'s weights; every dropout layer at ``dropout`` (a pretrained
    config brings its own rates). :class:`ModelFolderError` when the weights do not load."""
    from safetensors import SafetensorError

    config = gpt2_config(size, fast_gelu=fast_gelu, dropout=dropout)
    try:
        model = build_gpt2(config, model_path, fast_gelu=fast_gelu)
    except (OSError, SafetensorError) as e:  # e.g. weights truncated past their header
        raise ModelFolderError(f"cannot load {model_path} ({_first_line(e)})") from None
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    return model


def count_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once, as ``model.parameters()`` does)."""
    return sum(p.numel() for p in model.parameters())


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_blocks(model: torch.nn.Module, n: int) -> int:
    """Recompute the first ``n`` transformer blocks in backward; returns how many are wrapped.

    The early blocks are the ones to checkpoint: their recomputation in backward happens last,
    and their parameters' gradients arrive last anyway. State-dict keys are unchanged.
    """
    blocks = model.transformer.h
    if not 0 <= n <= len(blocks):
        raise ValueError(f"can checkpoint 0..{len(blocks)} blocks, got {n}")
    for block in list(blocks)[:n]:
        block.forward = functools.partial(_checkpointed_forward, block.forward)
    return n


def lm_loss(model: torch.nn.Module, input_ids: Tensor, chunk_tokens: int = 1024) -> Tensor:
    """Next-token loss of a ``GPT2LMHeadModel`` on ``input_ids`` (B, T): the same value as
    ``model(input_ids, labels=input_ids).loss``, without the (B, T, V) logits."""
    hidden = model.transformer(input_ids=input_ids, use_cache=False).last_hidden_state
    d = hidden.shape[-1]
    return chunked_lm_loss(
        hidden[:, :-1].reshape(-1, d),
        model.lm_head.weight,
        input_ids[:, 1:].reshape(-1),
        chunk_tokens,
    )


def backward_micro_batches(
    loss_of: Callable[[Tensor], Tensor], batch: Tensor, micro_batch: int, device: torch.device
) -> list[Tensor]:
    """Backward of ``loss_of`` on each ``micro_batch`` rows of ``batch`` (moved to ``device``;
    ``len(batch)`` a multiple of ``micro_batch``), each loss divided by the number of
    micro-batches, so the gradients summed in ``.grad`` are those of the whole batch's mean
    loss; returns those scaled losses, detached (their sum is the batch's loss; nothing is read
    back to the host)."""
    n_micro = len(batch) // micro_batch
    losses = []
    for mb in batch.split(micro_batch):
        loss = loss_of(mb.to(device, non_blocking=True)) / n_micro
        loss.backward()
        losses.append(loss.detach())
    return losses


def save_gpt2_folder(
    model: torch.nn.Module,
    folder: Path,
    tokenizer_dir: Path | None = None,
    notes: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a ``GPT2LMHeadModel``) as a Hugging Face folder that
    :func:`build_gpt2` loads: ``config.json`` and ``model.safetensors`` in the parameters' dtype
    (the tied LM head stored once), the :data:`TOKENIZER_FILES` of ``tokenizer_dir`` that exist,
    and ``notes`` as ``notes.json`` (provenance; loaders ignore it). ``model`` is not modified.

    Built in a temporary sibling folder and renamed to ``folder`` at the end, so an interrupted
    write leaves nothing under that name; ``FileExistsError`` if ``folder`` exists and is not
    empty (nothing is overwritten)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp"))
    try:
        model.save_pretrained(tmp)  # safetensors, the default
        for name in TOKENIZER_FILES:
            if tokenizer_dir is not None and (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, tmp / name)
        if notes is not None:
            (tmp / "notes.json").write_text(json.dumps(notes, indent=1, default=str))
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users
        try:
            tmp.rename(folder)
        except OSError:
            if folder.exists():
                raise FileExistsError(f"{folder} exists: not overwritten") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' logging at errors only, inside the block."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def check_model_folder(folder: Path, size: str):
    """The ``GPT2Config`` of the local folder ``folder``, checked against ``size`` (a key of
    :data:`SHAPES`) without loading any weights. :class:`ModelFolderError` for what
    ``from_pretrained`` would fail on or load wrongly: not a folder, no or unreadable
    config.json, another model type or shape, no readable weights, or weights missing (which
    Hugging Face would initialize at random with only a warning)."""
    from transformers import GPT2Config

    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder (expected {MODEL_FOLDER})")
    config_file = folder / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFolderError(f"{folder} has no config.json (expected {MODEL_FOLDER})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFolderError(f"{config_file} is not a readable JSON config ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != "gpt2":
        raise ModelFolderError(f"{config_file} has model_type {model_type!r}, expected 'gpt2'")
    try:
        with _quiet_transformers():  # its warnings about the config would precede our error
            config = GPT2Config.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ModelFolderError(f"{config_file}: not a GPT-2 config ({e})") from None
    keys = ("n_layer", "n_embd", "n_head", "vocab_size")
    found = {k: getattr(config, k) for k in keys}
    if found != {k: getattr(SHAPES[size], k) for k in keys}:
        sizes = [name for name, s in SHAPES.items() if found == {k: getattr(s, k) for k in keys}]
        hint = f"it is size {sizes[0]!r}" if sizes else f"sizes: {sorted(SHAPES)}"
        raise ModelFolderError(f"{config_file} describes {found}, not size {size!r} ({hint})")
    missing = expected_weights(config) - checkpoint_weights(folder)
    if missing:
        raise ModelFolderError(
            f"the weights in {folder} lack {len(missing)} tensors of GPT-2 "
            f"(e.g. {sorted(missing)[0]})"
        )
    return config


def _weight_name(key: str) -> str:
    """A checkpoint key without the ``transformer.`` prefix (hub checkpoints omit it)."""
    return key.removeprefix("transformer.")


def expected_weights(config) -> set[str]:
    """Names of the tensors a GPT-2 of ``config`` loads (the tied LM head excluded, the
    ``transformer.`` prefix dropped as hub checkpoints drop it)."""
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        names = GPT2LMHeadModel(config).state_dict().keys()
    tied = config.tie_word_embeddings
    return {_weight_name(k) for k in names if not (tied and k == "lm_head.weight")}


def checkpoint_weights(folder: Path) -> set[str]:
    """Names of the tensors stored in ``folder`` (read from headers or the index, no weights
    loaded); :class:`ModelFolderError` when it has none or they cannot be read."""
    from safetensors import SafetensorError, safe_open

    present = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not present:
        raise ModelFolderError(f"{folder} has no weights (expected {MODEL_FOLDER})")
    path = present[0]
    try:
        if path.name.endswith(".index.json"):
            keys = json.loads(path.read_text(encoding="utf-8"))["weight_map"].keys()
        elif path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as f:
                keys = list(f.keys())
        else:
            keys = torch.load(path, map_location="meta", weights_only=True, mmap=True).keys()
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RuntimeError,
            SafetensorError, json.JSONDecodeError) as e:  # fmt: skip
        raise ModelFolderError(f"cannot read the weights {path} ({_first_line(e)})") from None
    return {_weight_name(k) for k in keys}


def _first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, or its type's name when it has none."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__
