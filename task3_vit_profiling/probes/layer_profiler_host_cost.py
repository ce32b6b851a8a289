"""Host time that effdl's layer Profile adds per hooked module call (probe, CPU).

A stack of ``--layers`` tiny Linear layers on a tiny batch, so a bare training step (forward,
backward) is nearly all host time and the difference with Profile recording every step is the
hooks' own cost. Bare and profiled steps alternate in ``--rounds`` rounds; the medians give the
cost per module call (forward and backward of one module). ``--device cuda`` stamps with CUDA
events (the host time per step is still what is measured: the tiny kernels never make the host
wait). ``--cprofile N`` prints the N functions with the most own time over a profiled round
instead. Writes nothing.

    python task3_vit_profiling/probes/layer_profiler_host_cost.py
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch import nn

from effdl.profiling.layer_profiler import Profile


def train_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def step_times_us(
    model: nn.Module, x: torch.Tensor, steps: int, prof: Profile | None
) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        train_step(model, x)
        if prof is not None:
            prof.step()
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=100)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=50, help="steps per round")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cprofile", type=int, default=0, help="print this many cProfile rows")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(args.layers))).to(args.device)
    x = torch.randn(2, 4, device=args.device)
    modules = len(list(model.modules()))
    step_times_us(model, x, args.steps, None)  # warm-up
    if args.cprofile:
        with Profile(model) as prof, cProfile.Profile() as cp:
            step_times_us(model, x, args.steps, prof)
        pstats.Stats(cp).sort_stats("tottime").print_stats(args.cprofile)
        return
    bare, hooked = [], []
    for _ in range(args.rounds):
        bare += step_times_us(model, x, args.steps, None)
        with Profile(model) as prof:
            hooked += step_times_us(model, x, args.steps, prof)
    b, h = statistics.median(bare), statistics.median(hooked)
    print(f"{args.device}: {modules} modules hooked: bare step {b:.1f} us, profiled {h:.1f} us, "
          f"{(h - b) / modules:.2f} us per module call (forward + backward)")  # fmt: skip


if __name__ == "__main__":
    main()
