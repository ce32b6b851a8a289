"""torchao's CPUOffloadOptimizer training GPT-2 under train.py's caps: the peer of our offload.

Hugging Face's ``GPT2LMHeadModel`` (``gelu_new``, its own full-logits loss) with fp32 weights
and gradients on the GPU, bf16 autocast and gradient checkpointing in every block, its AdamW
step fused on the CPU by torchao; the same initial weights, batches, micro-batches, learning
rates and memory caps as train.py, timed by the same step code. Records ``torchao`` per step
and ``torchao_summary``, beside train.py's in ``gpt2.jsonl``. Run it right after train.py on
the same host: the speeds compare only there.

    python memory_efficient_gpt2/peer_torchao.py --device cuda --steps 8

Needs torchao (0.18); without it the run is refused in one line before anything starts.
"""

from __future__ import annotations

import functools

import torch

from effdl.cli import UsageError, base_parser, print_table, run_main, start_run
from effdl.gpt2_offload.config import FLAGS, OFFLOAD_ONLY_FLAGS, TrainConfig, parse_train_args
from effdl.gpt2_offload.inputs import initial_model, make_batches, model_folder_config
from effdl.gpt2_offload.steps import (
    check_memory_caps,
    gpu_peak_gib,
    hf_loss,
    host_rss_gib,
    run_plain,
    set_memory_cap,
    speed_summary,
)
from effdl.models.gpt2 import SHAPES, count_params, gpt2_config
from effdl.profiling.memory import use_expandable_segments
from effdl.results import RunLog
from effdl.tables import format_measured

TASK = "gpt2"
COLUMNS = ("step", "lr", "loss", "seq_per_s", "peak_gib", "host_rss_gib")
# train.py's flags that apply to torchao's optimizer (ours alone has moments, update location,
# accumulation mode, checkpoint choice, levels, the reference and the baseline runs)
PEER_FLAGS = tuple(name for name in FLAGS if name not in OFFLOAD_ONLY_FLAGS)
TORCHAO_MISSING = (
    "peer_torchao.py needs the torchao package (torchao 0.18): pip install torchao==0.18.0, "
    "or offline pip install --no-deps torchao-0.18.0-*.whl"
)


def import_torchao_offload() -> tuple[type, str]:
    """torchao's ``CPUOffloadOptimizer`` class and torchao's version; :class:`UsageError`
    naming the package when it is not installed."""
    try:
        import torchao
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise UsageError(TORCHAO_MISSING) from None
    return CPUOffloadOptimizer, torchao.__version__


def run_torchao_peer(
    cfg: TrainConfig,
    batches: list[torch.Tensor],
    device: torch.device,
    log: RunLog,
    seed: int,
    data: dict[str, str],
) -> tuple[list[dict], dict]:
    """Train on ``batches`` with torchao's optimizer as the module docstring says, the caps
    checked after set-up and after every step; returns the step metrics and the summary's."""
    offload_class, version = import_torchao_offload()
    if device.type == "cuda":
        set_memory_cap(device, cfg.memory_cap_gib)
    model = initial_model(cfg, seed, fast_gelu=False).to(device).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = offload_class(
        model.parameters(), torch.optim.AdamW, lr=cfg.lr, weight_decay=cfg.weight_decay
    )
    check_memory_caps(cfg, "after set-up", gpu_peak_gib(device), host_rss_gib())
    config = {
        "size": cfg.size, "n_params": count_params(model), "seq": cfg.seq, "batch": cfg.batch,
        "micro_batch": cfg.micro_batch, "n_micro": cfg.batch // cfg.micro_batch,
        "checkpoint_layers": SHAPES[cfg.size].n_layer, "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps, "lr_schedule": cfg.lr_schedule, "dropout": cfg.dropout,
        "cpu_threads": torch.get_num_threads(), "memory_cap_gib": cfg.memory_cap_gib,
        "host_memory_cap_gib": cfg.host_memory_cap_gib, **data,
        "pretrained": cfg.model_path is not None,
        "optimizer": f"torchao {version} CPUOffloadOptimizer(AdamW fused)", "weights": "fp32",
        "amp": "bf16",
    }  # fmt: skip
    loss_of = functools.partial(hf_loss, model, amp_dtype=torch.bfloat16)
    rows = run_plain("torchao", opt, loss_of, batches, cfg, device, log, config, True)
    return rows, speed_summary(rows, cfg.fixed_batch)


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    args, cfg = parse_train_args(parser, PEER_FLAGS)
    use_expandable_segments()  # as in train.py: the caps count the same memory
    # Every input is checked before the log is opened: a refused run leaves no record.
    model_config = model_folder_config(cfg.model_path, cfg.size, cfg.seq) or gpt2_config(cfg.size)
    import_torchao_offload()
    batches, data = make_batches(cfg, model_config.vocab_size, args.seed)
    run = start_run(args, task=TASK, logs="gpt2.jsonl")
    rows, summary = run_torchao_peer(cfg, batches, run.device, run.log, args.seed, data)
    table = [{k: r[k] for k in COLUMNS} for r in rows]
    print_table(table, title=f"torchao CPUOffloadOptimizer on {run.where} ({data['data']})")
    peak = format_measured(summary["peak_gib_max"])
    print(f"{summary['seq_per_s_median']:.2f} seq/s, peak {peak} GiB")


if __name__ == "__main__":
    run_main(main)
