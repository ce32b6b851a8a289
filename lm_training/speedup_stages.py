"""The LM speed-up study: the GPT-like LM trained stage by stage, from a first attempt to torch.compile.

Stage 0 is fp32, BRAIN padding and a loop with planted inefficiencies; every later stage adds
one fix (``effdl.lm.stages`` lists them). All stages train the same seeded model on
the same documents per step (the same real tokens; padding never counts) for the same number of
steps: ``--warmup-steps`` untimed, then the stages take turns of ``--block-steps`` timed steps
(each turn opens with one untimed step), so that a drift of the host's speed over the run falls
on every stage alike, then ``--profile-steps`` under torch.profiler (a gzipped Chrome trace per
stage in ``--trace-dir``, Perfetto-viewable).

    python3 lm_training/speedup_stages.py --quick                  # CPU: tiny model, seconds
    python3 lm_training/speedup_stages.py --device cuda            # d 1024, seq 640, all stages
    python3 lm_training/speedup_stages.py --device cuda --stage 3  # one stage (cumulative config)

Data: the standard-library corpus (``effdl.data.stdlib_text``) cut into paragraphs (blocks
between blank lines, a heavy-tailed length distribution like WikiText's lines), BPE-tokenized
with a ``<bos>`` in front and truncated to ``--max-length``. One record per stage in
``--out/speedup_stages.jsonl``; on the CPU the compile stage is skipped (logged as such) unless
``--compile-on-cpu``. A stage whose loss turns non-finite is refused, naming ``--lr``.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from effdl.cli import (
    ConfigFlags,
    Run,
    UsageError,
    base_parser,
    print_table,
    require_choices,
    require_converged,
    require_fits,
    require_positive,
    require_processes,
    require_writable_folder,
    run_main,
    start_run,
)
from effdl.data.parquet import read_text_column
from effdl.data.stdlib_text import DEFAULT_CACHE, text_blocks
from effdl.data.tokenize import TokenizedCorpus, encode_with_tokenizer
from effdl.lm import data as lm_data
from effdl.lm import stages as st
from effdl.models.gpt_like import config_from_sizes
from effdl.profiling.kernel_split import read_trace_events, step_breakdown
from effdl.profiling.timing import GIB, peak_memory

TASK = "lm_training"
LOG = "speedup_stages.jsonl"


@dataclass(frozen=True)
class StudyConfig:
    """Settings shared by every stage; every field is a flag (``tokens_per_step`` ->
    ``--tokens-per-step``). The model defaults are seed 001's (d 1024, 8 heads, one decoder
    layer, feed-forward 2048) without dropout, so stages differ in speed only."""

    steps: int = 150
    warmup_steps: int = 10
    profile_steps: int = 4
    block_steps: int = 8  # timed steps per turn of a stage (after one untimed step)
    tokens_per_step: int = 16384  # real tokens of every step
    max_length: int = 640
    d_model: int = 1024
    n_heads: int = 8
    n_layers: int = 1
    d_ff: int = 2048
    lr: float = 3e-4
    amp_dtype: str = "bf16"  # no scaler, so no per-step overflow read (a host sync)
    workers: int = 4
    bpe_vocab: int = 8192
    corpus_bytes: int | None = None  # None: the whole stdlib corpus
    cache: Path = DEFAULT_CACHE
    compile_on_cpu: bool = False
    layer_norm: str = "fused"

    @property
    def interleaved_steps(self) -> int:
        """The steps between the warm-up and the profiled ones, run in blocks stage by stage."""
        return self.steps - self.warmup_steps - self.profile_steps

    def validate(self) -> None:
        require_positive(self, "steps", "tokens_per_step", "max_length", "d_model", "n_heads")
        require_positive(self, "n_layers", "d_ff", "bpe_vocab", "profile_steps", "block_steps")
        require_positive(self, "warmup_steps", minimum=0)
        require_processes(self, "workers")
        require_positive(self, "lr", minimum=0)
        require_choices(self, "amp_dtype", ("fp16", "bf16"))
        require_choices(self, "layer_norm", tuple(st.LAYER_NORMS))
        require_fits(
            "--tokens-per-step --max-length --d-model --d-ff --n-layers",
            self.n_layers
            * (self.tokens_per_step * (self.d_model + self.d_ff) + self.d_model * self.d_ff)
            + self.max_length * self.d_model,
            "a step's activations and the weights (fp32)",
        )
        if self.tokens_per_step < self.max_length:
            raise UsageError(
                f"--tokens-per-step {self.tokens_per_step} is below --max-length "
                f"{self.max_length}: a step must hold the longest document"
            )
        if self.interleaved_steps < 2:
            raise UsageError(
                f"--steps {self.steps} leaves fewer than 2 steps (an untimed and a timed one) "
                f"after --warmup-steps {self.warmup_steps} and --profile-steps {self.profile_steps}"
            )


FULL = StudyConfig()
QUICK = replace(
    FULL,
    steps=4,
    warmup_steps=1,
    profile_steps=1,
    tokens_per_step=128,
    max_length=32,
    d_model=64,
    n_heads=4,
    d_ff=128,
    workers=1,
    bpe_vocab=512,
    corpus_bytes=1 << 20,
)


def stage_list(text: str) -> list[int]:
    """argparse type of ``--stages``: ``all`` or comma-separated stage numbers."""
    n = len(st.STAGE_FLAGS) + 1
    if text == "all":
        return list(range(n))
    try:
        picked = sorted({int(s) for s in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'all' or numbers like 0,3, got {text!r}"
        ) from None
    if picked[0] < 0 or picked[-1] >= n:
        raise argparse.ArgumentTypeError(f"stages are 0..{n - 1}, got {text!r}")
    return picked


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, StudyConfig]:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/lm_training")
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--stage", type=stage_list, dest="stages", default=argparse.SUPPRESS, help="one stage"
    )
    which.add_argument("--stages", type=stage_list, default="all", help="'all' or e.g. 0,2,5")
    p.add_argument("--trace-dir", type=Path, help="folder of the traces; default --out/traces")
    flags = ConfigFlags(p, FULL, QUICK)
    flags.add("steps", type=int, help="optimizer steps of every stage")
    flags.add("warmup_steps", type=int, help="first steps, untimed")
    flags.add("profile_steps", type=int, help="last steps, under torch.profiler")
    flags.add("block_steps", type=int, help="timed steps of a stage's turn (stages take turns)")
    flags.add("tokens_per_step", type=int, help="real (non-padding) tokens of every step")
    flags.add("max_length", type=int, help="longest document and packed row")
    flags.add("d_model", type=int)
    flags.add("n_heads", type=int)
    flags.add("n_layers", type=int)
    flags.add("d_ff", type=int)
    flags.add("lr", type=float, help="Adam learning rate")
    flags.add("amp_dtype", choices=["fp16", "bf16"], help="fp16 adds a scaler (a sync)")
    flags.add("workers", type=int, help="DataLoader workers once the loader is fixed")
    flags.add("bpe_vocab", type=int, help="vocabulary of the stdlib BPE")
    flags.add("corpus_bytes", type=int, help="cap of the stdlib corpus; None = all of it")
    flags.add("cache", type=Path, output=True, help="folder for the corpus parquets and the BPE")
    flags.add("compile_on_cpu", action="store_true", help="run the compile stage on a CPU too")
    flags.add("layer_norm", choices=list(st.LAYER_NORMS),
              help="what the fused_layer_norm stage swaps in; torch: its kernel in the"
                   " activations' dtype; triton: the Triton kernels at any size (the ablations)")  # fmt: skip
    args = p.parse_args(argv)
    cfg = flags.resolve(args)
    if args.trace_dir is not None:
        require_writable_folder(args.trace_dir, "--trace-dir")
    return args, cfg


# ------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class StudyData:
    plan: st.StepPlan
    pad_id: int
    vocab_size: int
    corpus: str
    documents: int
    mean_length: float


def load_data(cfg: StudyConfig, seed: int) -> StudyData:
    """The stdlib corpus as BPE paragraphs (``<bos>`` first, cut to ``max_length``) and the
    step plan every stage trains on."""
    source = lm_data.resolve_data(None, None, cfg.cache, cfg.corpus_bytes)
    tokenizer, specials = lm_data.load_tokenizer(
        lm_data.default_tokenizer(cfg.cache, cfg.corpus_bytes, cfg.bpe_vocab)
    )
    texts = read_text_column(source.train).to_pylist()
    docs: TokenizedCorpus = encode_with_tokenizer(tokenizer, text_blocks(texts), specials.bos)
    docs = docs.truncate(cfg.max_length, min_length=2)
    if cfg.steps * cfg.tokens_per_step > docs.n_tokens:
        print(f"note: {cfg.steps} steps of {cfg.tokens_per_step} tokens pass over the corpus "
              f"({docs.n_tokens:,} tokens) more than once")  # fmt: skip
    plan = st.plan_steps(
        [docs[i] for i in range(len(docs))], cfg.steps, cfg.tokens_per_step, cfg.max_length, seed
    )
    return StudyData(
        plan=plan,
        pad_id=specials.pad,
        vocab_size=tokenizer.get_vocab_size(),
        corpus=source.name,
        documents=len(docs),
        mean_length=float(docs.lengths.mean()),
    )


# ----------------------------------------------------------------------------------- traces
def profiled_steps(
    batches, parts: st.StepParts, losses: st.LossLog, first: int, n: int, trace: Path
) -> dict:
    """``n`` steps under torch.profiler; writes the gzipped Chrome trace, returns the breakdown."""
    activities = [ProfilerActivity.CPU]
    if parts.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for step in range(first, first + n):
            with torch.profiler.record_function("step"):
                loss, _ = st.train_step(batches, parts)
                losses.add(step, loss)
        if parts.device.type == "cuda":
            torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return step_breakdown(read_trace_events(trace), n, st.RANGES)


# ---------------------------------------------------------------------------------- stages
def start_stage(index: int, cfg: StudyConfig, data: StudyData, run: Run) -> st.StageRun:
    """Stage ``index`` built from the seeded initial weights and its warm-up steps run."""
    stage = st.stages()[index]
    with peak_memory(run.device) as mem:
        model_cfg = config_from_sizes(cfg, data.vocab_size, dropout=0.0)
        model = st.build_model(model_cfg, stage, run.device, run.seed, cfg.layer_norm)
        parts = st.StepParts(
            model=model,
            optimizer=st.build_optimizer(model, stage, cfg.lr),
            precision=st.stage_precision(stage, run.device, cfg.amp_dtype),
            stage=stage,
            device=run.device,
            pad_id=data.pad_id,
        )
        block = model.loader_block_size(run.device)
        loader = st.step_loader(data.plan, stage, data.pad_id, block, cfg.workers, run.device)
        sr = st.StageRun(index, parts, iter(loader), st.LossLog(stage.loss_read_once))
        sr.train(cfg.warmup_steps)
    sr.add_peak(mem, held=0)
    if run.device.type == "cuda":
        sr.resident = torch.cuda.memory_allocated(run.device) - mem.start_bytes
    return sr


def finish_stage(sr: st.StageRun, cfg: StudyConfig, trace_dir: Path) -> dict:
    """The profiled steps, the loss check and the stage's metrics."""
    trace = trace_dir / f"{st.stage_name(sr.index)}.json.gz"
    breakdown = profiled_steps(sr.batches, sr.parts, sr.losses, sr.step, cfg.profile_steps, trace)
    curve = sr.losses.values()
    for step, loss in enumerate(curve):  # a speed study: no stage may diverge
        require_converged("--lr", f"{st.stage_name(sr.index)} at step {step}", loss)
    median = float(np.median(sr.step_s))
    return {
        "tokens_per_step": cfg.tokens_per_step,
        "steps": cfg.steps,
        "timed_steps": len(sr.step_s),
        "blocks": len(st.block_sizes(cfg.interleaved_steps, cfg.block_steps)),
        "step_s_median": median,
        "step_s": sr.step_s,
        "tokens_per_s": cfg.tokens_per_step / median,
        "tokens_per_s_mean": cfg.tokens_per_step * len(sr.step_s) / sum(sr.step_s),
        "padding_fraction": 1 - cfg.tokens_per_step * len(sr.slots) / sum(sr.slots),
        "peak_mem_gib": None if sr.peak is None else sr.peak / GIB,  # None: CPU, not measured
        "loss_curve": curve,
        "final_loss": curve[-1],
        "breakdown": breakdown,
        "trace": str(trace),
        "skipped": None,
    }


def run_stages(
    indices: list[int], cfg: StudyConfig, data: StudyData, run: Run, trace_dir: Path
) -> dict[int, dict]:
    """Every stage of ``indices`` built and warmed up, then trained in turns of one block each
    (so a drift of the host's or the GPU's speed falls on all of them alike), then profiled."""
    runs = [start_stage(i, cfg, data, run) for i in tqdm(indices, desc="build + warm up")]
    for size in tqdm(st.block_sizes(cfg.interleaved_steps, cfg.block_steps), desc="blocks"):
        for sr in runs:
            st.timed_block(sr, size)
    return {sr.index: finish_stage(sr, cfg, trace_dir) for sr in runs}


def stage_record_config(index: int, cfg: StudyConfig, data: StudyData, run: Run) -> dict:
    stage = st.stages()[index]
    added = st.STAGE_FLAGS[index - 1] if index else ("baseline", "stage 0: the first attempt")
    return {
        "stage": index,
        "fix": added[0],
        "fix_description": added[1],
        "fixes": stage.fixes,
        **{k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "corpus": f"{data.corpus} paragraphs",
        "documents": data.documents,
        "mean_document_tokens": data.mean_length,
        "rows_packed": data.plan.rows_packed,
        "vocab_size": data.vocab_size,
        "device": str(run.device),
        "seed": run.seed,
    }


def main(argv: list[str] | None = None) -> None:
    args, cfg = parse_args(argv)
    run = start_run(args, TASK, LOG)
    trace_dir = args.trace_dir or run.out / "traces"
    data = load_data(cfg, run.seed)
    skipped, measured = [], []
    for index in args.stages:
        if st.stages()[index].compile and run.device.type == "cpu" and not cfg.compile_on_cpu:
            skipped.append(index)
        else:
            measured.append(index)
    metrics = run_stages(measured, cfg, data, run, trace_dir) if measured else {}
    rows = []
    for index in args.stages:
        config = stage_record_config(index, cfg, data, run)
        if index in skipped:
            reason = "compile stage skipped on the CPU (minutes of compilation; --compile-on-cpu)"
            print(f"note: {reason}")
            run.log.log(st.stage_name(index), config, {"skipped": reason})
            continue
        m = metrics[index]
        run.log.log(st.stage_name(index), config, m)
        rows.append({
            "stage": st.stage_name(index),
            "tokens/s": m["tokens_per_s"],
            "x prev": m["tokens_per_s"] / rows[-1]["tokens/s"] if rows else 1.0,
            "x first": m["tokens_per_s"] / rows[0]["tokens/s"] if rows else 1.0,
            "peak GiB": m["peak_mem_gib"],
            "final loss": m["final_loss"],
        })  # fmt: skip
    print_table(rows, title=f"Speed-up stages on {run.where} (log: {run.log.path})")


if __name__ == "__main__":
    run_main(main)
