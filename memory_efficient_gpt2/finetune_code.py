"""Fine-tune GPT-2-XL on the Python standard library's code at level 3, and compare before/after.

Level 3's settings by default (effdl.gpt2_offload.config.LEVELS[3]: GPT-2-XL, peak GPU memory
<= 11 GiB, the process's resident set <= 16 GiB, fp32 master weights with block-wise 8-bit Adam
moments on the host updated on the GPU, a bf16 gradient accumulator), trained by the same
offloaded-Adam steps as train.py (effdl.gpt2_offload.run), from the weights of ``--model-path``.

    python memory_efficient_gpt2/finetune_code.py --quick                   # CPU smoke run, tiny GPT-2
    python memory_efficient_gpt2/pretrain.py --device cuda --corpus docs --size xl --batch 16 --skip-tokens 16384 --steps 40 --warmup-steps 4 --save /tmp/xl-docs
    python memory_efficient_gpt2/finetune_code.py --device cuda --model-path /tmp/xl-docs

Data (effdl.data.stdlib_code): the running Python's stdlib ``.py`` files, split by a hash of
each file's path into training files and ``--heldout-percent`` held-out files; the model trains
on the training files only (their tokens cut into ``--seq`` windows, drawn in a seeded order,
a new order each pass). Starting weights from pretrain.py must come from ``--corpus docs`` (the
documentation alone): a folder pretrained on the whole stdlib corpus has seen held-out files
and is refused. Text is read by the folder's tokenizer (pretrain.py saves its BPE there), or,
without ``--model-path``, by the code corpus's BPE of ``--bpe-vocab`` ids (random init).

Before and after the fine-tune, on the same bf16 working weights the steps train: the held-out
code loss (mean next-token loss over the held-out files' ``--seq`` rows, the first
``--heldout-windows``), and continuations of ``--prompts`` prompts cut from held-out files
(function signatures with their docstrings, class headers with theirs; effdl.data.code_prompts),
each greedy and sampled (``--temperature``, ``--top-k``, a generator seeded ``--seed`` + the
prompt's index), ``--max-new-tokens`` each.

Records in ``--out/gpt2_finetune_code.jsonl``: ``corpus`` (the files of each side, tokens,
prompts), ``memory_budget``, ``heldout_loss`` (``config.phase`` before), one ``before`` record
per prompt and mode (the prompt and its continuation as text), one ``finetune`` record per
step, ``heldout_loss`` and ``after`` records likewise, ``finetune_summary``. Past either memory
cap the run stops with MemoryCapExceeded before the record it would spoil.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch

from effdl.cli import (
    UsageError,
    base_parser,
    device_from_arg,
    print_table,
    require_positive,
    run_main,
    start_run,
)
from effdl.data.corpus import CorpusFormatError
from effdl.data.stdlib_code import HELDOUT_PERCENT, stdlib_code_corpus
from effdl.gpt2_offload.budget import require_run_fits
from effdl.gpt2_offload.code_data import CodeData, code_data, finetune_codec, pretraining_corpus
from effdl.gpt2_offload.config import FLAGS, LEVELS, TrainConfig, parse_train_args
from effdl.gpt2_offload.evaluate import Sampling, continuations, heldout_loss
from effdl.gpt2_offload.inputs import model_folder_config, step_windows
from effdl.gpt2_offload.run import OffloadRun, start_offload, summarize, train_offload
from effdl.gpt2_offload.steps import check_memory_caps, gpu_peak_gib, host_rss_gib
from effdl.models.gpt2 import SHAPES, gpt2_config
from effdl.profiling.memory import use_expandable_segments
from effdl.results import RunLog
from effdl.tables import format_measured

TASK = "gpt2"
LOG = "gpt2_finetune_code.jsonl"
SHOWN_CHARS = 56  # of a continuation in the printed table (the log holds all of it)
# train.py's flags that apply here: not its data, fixed batch, reference or baseline runs
NOT_HERE = ("fixed_batch", "data", "reference", "baseline", "baseline_micro_batches")
TRAIN_FLAGS = [name for name in FLAGS if name not in NOT_HERE]


@dataclass(frozen=True)
class FinetuneConfig(TrainConfig):
    """train.py's settings (its training flags) and what the comparison adds."""

    heldout_percent: int = HELDOUT_PERCENT  # of the code files, by path hash
    prompts: int = 10  # a third class headers, the rest function signatures
    max_new_tokens: int = 64
    temperature: float = 0.8  # of the sampled continuation
    top_k: int = 40
    heldout_windows: int | None = None  # held-out rows evaluated; None: all

    def validate(self) -> None:
        super().validate()
        require_positive(self, "prompts", "max_new_tokens", "top_k")
        if self.heldout_windows is not None:
            require_positive(self, "heldout_windows")
        if not 0 < self.heldout_percent < 100:
            raise UsageError(f"--heldout-percent must be in 1..99, got {self.heldout_percent}")
        if not self.temperature > 0:
            raise UsageError(f"--temperature must be > 0, got {self.temperature}")
        half = SHAPES[self.size].n_positions // 2
        if self.max_new_tokens > half:
            raise UsageError(
                f"--max-new-tokens {self.max_new_tokens}: at most {half}, half of GPT-2's "
                "positions (the prompt needs the rest)"
            )


FULL = FinetuneConfig(
    **LEVELS[3], level=3, steps=100, lr=1e-4, warmup_steps=4, lr_schedule="cosine"
)  # fmt: skip
QUICK = FinetuneConfig(
    size="tiny", steps=4, batch=8, seq=64, micro_batch=2, lr=1e-3, warmup_steps=1,
    bpe_vocab=512, corpus_bytes=1 << 20, moments="int8", grad_accumulation_dtype="bf16",
    max_new_tokens=8, heldout_windows=32,
)  # fmt: skip
EXTRA_FLAGS = {
    "heldout_percent": {"type": int, "help": "share of the code files held out, by path hash"},
    "prompts": {"type": int, "help": "held-out prompts continued before and after"},
    "max_new_tokens": {"type": int, "help": "tokens generated per continuation"},
    "temperature": {"type": float, "help": "of the sampled continuations"},
    "top_k": {"type": int, "help": "the sampled continuations draw from this many ids"},
    "heldout_windows": {"type": int, "help": "held-out rows of --seq tokens evaluated; None = all"},
}


def parse_args() -> tuple[argparse.Namespace, FinetuneConfig]:
    """The command line: the common flags, train.py's training flags, the comparison's."""
    parser = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    return parse_train_args(parser, TRAIN_FLAGS, FULL, QUICK, EXTRA_FLAGS)


def load_data(cfg: FinetuneConfig, vocab: int) -> CodeData:
    """The code corpus split, read by the run's tokenizer (effdl.gpt2_offload.code_data);
    :class:`UsageError` naming the flag when it cannot feed the run."""
    corpus = stdlib_code_corpus(cfg.corpus_bytes, cfg.heldout_percent)
    try:
        codec = finetune_codec(cfg.model_path, corpus, cfg.bpe_vocab, cfg.cache)
        prompt_tokens = SHAPES[cfg.size].n_positions - cfg.max_new_tokens
        data = code_data(corpus, codec, cfg.seq, vocab, cfg.prompts, prompt_tokens,
                         cfg.heldout_windows)  # fmt: skip
    except CorpusFormatError as e:
        raise UsageError(f"--model-path: {e}") from None
    except ValueError as e:  # too few prompts in the held-out files
        raise UsageError(f"--prompts {cfg.prompts}: {e} (raise --corpus-bytes)") from None
    if len(data.windows) < cfg.batch or len(data.heldout) == 0:
        raise UsageError(
            f"{corpus.name}: {len(data.windows)} training windows and {len(data.heldout)} "
            f"held-out rows of --seq {cfg.seq}, need --batch {cfg.batch} and one (raise "
            "--corpus-bytes)"
        )
    return data


def evaluate(
    run: OffloadRun,
    data: CodeData,
    cfg: FinetuneConfig,
    sampling: Sampling,
    device: torch.device,
    log: RunLog,
    phase: str,
) -> dict:
    """The held-out loss (a ``heldout_loss`` record) and every prompt's continuations (a
    ``phase`` record each, as it is made), both memory caps checked after them; returns the
    loss and the continuations."""
    loss = heldout_loss(run.model, data.heldout, cfg.micro_batch, cfg.chunk_tokens, device)
    rows = {"loss": loss, "rows": len(data.heldout), "tokens": data.heldout.numel()}
    log.log("heldout_loss", {**run.config, "phase": phase}, rows)
    made = []
    for gen in continuations(run.model, data.prompt_ids, sampling, data.codec.decode,
                             data.stop_ids):  # fmt: skip
        p = data.prompts[gen["prompt"]]
        config = {"phase": phase, "path": p.path, "name": p.name, "kind": p.kind, "line": p.line,
                  **dataclasses.asdict(sampling), "size": cfg.size, "level": cfg.level}  # fmt: skip
        log.log(phase, config, {**gen, "prompt_text": p.text})
        made.append(gen)
    check_memory_caps(cfg, f"{phase} the fine-tune", gpu_peak_gib(device), host_rss_gib())
    return {"heldout_loss": loss, "continuations": made}


def shown(text: str) -> str:
    """A continuation on one line of the table, clipped."""
    flat = text.replace("\n", "\\n")
    return flat if len(flat) <= SHOWN_CHARS else flat[: SHOWN_CHARS - 3] + "..."


def print_comparison(data: CodeData, before: dict, after: dict, summary: dict) -> None:
    """Each prompt's continuations before and after side by side, then the held-out loss."""
    rows = []
    for b, a in zip(before["continuations"], after["continuations"], strict=True):
        p = data.prompts[b["prompt"]]
        rows.append({"prompt": f"{p.path}:{p.name}", "mode": b["mode"],
                     "before": shown(b["completion"]), "after": shown(a["completion"])})  # fmt: skip
    print_table(
        rows, title="Held-out prompts: continuations before and after (full text in the log)"
    )
    print(
        f"held-out code loss {summary['heldout_loss_before']:.4f} -> "
        f"{summary['heldout_loss_after']:.4f} nats/token over {data.heldout.numel():,} tokens "
        f"of {len(data.corpus.heldout)} held-out files; trained {summary['steps']} steps on "
        f"{len(data.corpus.train)} training files, {summary['seq_per_s_median']:.2f} seq/s, "
        f"peak GPU {format_measured(summary['peak_gib_max'])} GiB, "
        f"host {summary['host_rss_peak_gib']:.3f} GiB"
    )


def main() -> None:
    args, cfg = parse_args()
    use_expandable_segments()  # as in train.py: the caps count the same memory
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = model_folder_config(cfg.model_path, cfg.size, cfg.seq) or gpt2_config(cfg.size)
    pretrained_on = pretraining_corpus(cfg.model_path)
    device = device_from_arg("cpu" if args.quick and args.device == "auto" else args.device)
    require_run_fits(cfg, model_config, device)
    data = load_data(cfg, model_config.vocab_size)
    run = start_run(args, task=TASK, logs=LOG)
    names = {"data": data.corpus.name, "tokenizer": data.codec.name, "pretrained_on": pretrained_on}
    run.log.log("corpus", {**names, "heldout_percent": cfg.heldout_percent}, data.summary())
    offload = start_offload(cfg, run.device, run.log, args.seed, names)
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_k, args.seed)
    before = evaluate(offload, data, cfg, sampling, run.device, run.log, "before")
    draws = step_windows(data.windows, cfg.batch, args.seed)
    batches = [next(draws) for _ in range(cfg.steps)]
    rows = train_offload(offload, cfg, batches, run.device, run.log, "finetune")
    after = evaluate(offload, data, cfg, sampling, run.device, run.log, "after")
    offload.opt.close()
    summary = {
        **summarize(rows, False, offload.budget),
        "heldout_loss_before": before["heldout_loss"],
        "heldout_loss_after": after["heldout_loss"],
        "heldout_loss_change": after["heldout_loss"] - before["heldout_loss"],
        "passes": cfg.steps * cfg.batch / len(data.windows),
    }
    run.log.log("finetune_summary", offload.config, summary)
    print_comparison(data, before, after, summary)


if __name__ == "__main__":
    run_main(main)
