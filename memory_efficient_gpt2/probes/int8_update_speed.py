"""Nanoseconds per value of CPUOffloadAdam's int8 update: on the host vs on the device.

A set of ``--values`` parameters (default 2**28, 256M, about a sixth of GPT-2-XL) in tensors of
``--tensor-numel``, bf16 working weights, gradients accumulated on the device. Each step's
backward is not final, so every bucket updates inside ``step()``: the timed ``step()`` is the
update alone (gradients down, update, weights up for "host"; masters and moments up, update,
back for "device"), not overlapped with any backward. The first step warms up; the rest are
timed. Also logs the timeline's split (h2d, d2h, cpu_update, device_update seconds).

    python memory_efficient_gpt2/probes/int8_update_speed.py --device cuda --out runs/gpt2
    python memory_efficient_gpt2/probes/int8_update_speed.py --quick       # CPU smoke run
"""

from __future__ import annotations

import statistics
import time

import torch

from effdl.cli import base_parser, print_table, require_fits, require_positive, run_main, start_run
from effdl.optim import CPUOffloadAdam


def build_params(values: int, tensor_numel: int, seed: int) -> list[torch.nn.Parameter]:
    """fp32 CPU parameters holding ``values`` values in tensors of ``tensor_numel``."""
    g = torch.Generator().manual_seed(seed)
    sizes = [tensor_numel] * (values // tensor_numel) + [values % tensor_numel]
    return [torch.nn.Parameter(torch.randn(n, generator=g) * 0.02) for n in sizes if n]


def time_updates(opt: CPUOffloadAdam, params: list, device: torch.device, steps: int) -> dict:
    """Seconds of ``opt.step()`` per step (median over all but the first) and the timeline
    split of the last step; gradients are fixed random directions (loss = sum(p * r))."""
    directions = [torch.randn_like(p, dtype=torch.bfloat16) for p in params]
    seconds = []
    for _ in range(steps):
        loss = sum((p.float() * r.float()).sum() for p, r in zip(params, directions, strict=True))
        opt.backward(loss)  # not final: every update runs inside step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        opt.timeline.reset()
        start = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return {
        "step_s": statistics.median(seconds[1:]),
        **{f"{k}_s": v for k, v in opt.timeline.totals().items()},
    }


def main() -> None:
    p = base_parser(__doc__.splitlines()[0], default_out="runs/gpt2")
    p.add_argument("--values", type=int, default=2**28, help="parameters in the set")
    p.add_argument("--tensor-numel", type=int, default=2**24, help="values per parameter")
    p.add_argument("--bucket-numel", type=int, default=2**25, help="CPUOffloadAdam buckets")
    p.add_argument("--steps", type=int, default=4, help="steps per variant (first: warm-up)")
    args = p.parse_args()
    require_positive(args, "values", "tensor_numel", "bucket_numel")
    require_positive(args, "steps")
    require_fits(
        "--values", (2**22 if args.quick else args.values) * 4, "the fp32 values and their state"
    )
    run = start_run(args, task="gpt2", logs="int8_update_speed.jsonl")
    values = 2**22 if args.quick else args.values
    tensor_numel = min(args.tensor_numel, values)
    rows = []
    for update_on in ("host", "device"):
        params = build_params(values, tensor_numel, args.seed)
        opt = CPUOffloadAdam(
            params, lr=1e-4, device=run.device, moments="int8", update_on=update_on,
            grad_accumulation="gpu", bucket_numel=args.bucket_numel,
        )  # fmt: skip
        opt.timeline.enabled = True
        metrics = time_updates(opt, params, run.device, max(args.steps, 2))
        opt.close()
        metrics["ns_per_value"] = metrics["step_s"] / values * 1e9
        config = {"values": values, "tensor_numel": tensor_numel, "update_on": update_on,
                  "bucket_numel": args.bucket_numel, "steps": args.steps,
                  "threads": torch.get_num_threads(), "device": str(run.device)}  # fmt: skip
        run.log.log(f"int8_update_{update_on}", config, metrics)
        rows.append({"update_on": update_on, "ns/value": round(metrics["ns_per_value"], 3),
                     "step s": round(metrics["step_s"], 3)})  # fmt: skip
        del opt, params
    print_table(rows, title=f"int8 Adam update of {values:,} values on {run.where}")


if __name__ == "__main__":
    run_main(main)
