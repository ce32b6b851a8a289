"""Fewer kernel launches per level-0 step at the host-bound bf16 configs (probe, H100).

At 16x128 / 32x128 / 8x512 the step is bound by the host's launches, and level 0 launches as many
kernels as the reference module (17 per layer and step with the residual add). Prototypes here,
all level 0 with every gradient wanted:

  lib        effdl's MemoryOptimizedSwigluMLP (PyTorch elementwise path at these sizes)
  jit        the elementwise part as torch.cuda.jiterator kernels: gate 1 launch (was 2),
             gate backward 1 launch with two outputs (was 4)                          -4 / layer
  jit_bmm    jit, and xW, xV as one batched GEMM over W, V stored as one (2, H, I) tensor -5
  torch_bmm2 PyTorch elementwise path writing dA, dB into one (2, N, I) buffer, so dW, dV are
             one batched GEMM too (xW, xV batched as well)                           -2
  sel_bmm2   jit_bmm, and the backward jiterator writes dA, dB as one (2, N, I) output (inputs
             broadcast over a selector), so dW, dV are one batched GEMM              -6

Variants are alive together and take turns in rounds of chunks of back-to-back steps (as
swiglu_checkpoint/benchmark.py); median step time per chunk; peak memory of one step each. Then
GEMM-only timings at the large configs: two mm against one bmm over the (2, H, I) weights.
Needs CUDA. Writes ``--out/fewer_launches.jsonl``, told apart by ``config.kind``: ``check``
(each prototype's max error against the reference), ``step`` (per config and variant: step ms
median and quartiles over the chunks, peak MiB, both over the reference's) and ``gemm``.
"""

from __future__ import annotations

import argparse
import math
import statistics as st
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.cuda.jiterator import _create_jit_fn, _create_multi_output_jit_fn

from effdl.models.swiglu import MLPStack, SwigluMLP
from effdl.ops.swiglu import MemoryOptimizedSwigluMLP
from effdl.results import RunLog

dev = torch.device("cuda")
GATE = _create_jit_fn(
    "template <typename T> T swiglu_gate(T a, T b) {"
    " float x = static_cast<float>(a);"
    " return static_cast<T>(x / (1.0f + ::expf(-x)) * static_cast<float>(b)); }"
)
GATE_BWD = _create_multi_output_jit_fn(
    "template <typename T> void swiglu_gate_bwd(T a, T b, T dg, T& da, T& db) {"
    " float x = static_cast<float>(a), y = static_cast<float>(b), d = static_cast<float>(dg);"
    " float s = 1.0f / (1.0f + ::expf(-x));"
    " da = static_cast<T>(d * y * s * (1.0f + x * (1.0f - s)));"
    " db = static_cast<T>(d * x * s); }",
    num_outputs=2,
)
GATE_BWD_SEL = _create_jit_fn(
    "template <typename T> T swiglu_dab(T a, T b, T dg, T sel) {"
    " float x = static_cast<float>(a), y = static_cast<float>(b), d = static_cast<float>(dg);"
    " float s = 1.0f / (1.0f + ::expf(-x));"
    " return static_cast<T>(static_cast<float>(sel) == 0.0f"
    " ? d * y * s * (1.0f + x * (1.0f - s)) : d * x * s); }"
)


def stacked(W, V):
    """W, V as one (2, H, I) view when they are consecutive in one storage, else None."""
    if (
        W.is_contiguous()
        and V.is_contiguous()
        and W.untyped_storage().data_ptr() == V.untyped_storage().data_ptr()
        and V.data_ptr() - W.data_ptr() == W.numel() * W.element_size()
    ):
        return W.as_strided((2, *W.shape), (W.numel(), *W.stride()))
    return None


class Proto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W, V, U, mode):
        x2 = x.reshape(-1, x.shape[-1])
        wv = stacked(W, V) if mode != "jit" else None
        if wv is not None:
            ab = torch.bmm(x2.unsqueeze(0).expand(2, *x2.shape), wv)
            a, b = ab[0], ab[1]
        else:
            a, b = torch.mm(x2, W), torch.mm(x2, V)
        g = F.silu(a).mul_(b) if mode == "torch_bmm2" else GATE(a, b)
        y = torch.mm(g, U)
        ctx.save_for_backward(x, W, V, U, a, b, g)
        ctx.mode = mode
        return y.view(*x.shape[:-1], U.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x, W, V, U, a, b, g = ctx.saved_tensors
        mode = ctx.mode
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dg = torch.mm(dy2, U.t())
        dab = None
        if mode == "sel_bmm2":
            dab = GATE_BWD_SEL(a[None], b[None], dg[None], SEL[a.dtype])
            da, db = dab[0], dab[1]
        elif mode == "torch_bmm2":
            dab = torch.empty((2, *a.shape), device=a.device, dtype=a.dtype)
            da, db = dab[0], dab[1]
            s = F.silu(a)
            torch.ops.aten.silu_backward.grad_input(b, a, grad_input=da)
            da.mul_(dg)
            torch.mul(dg, s, out=db)
            del s
        else:
            da, db = GATE_BWD(a, b, dg)
        del dg
        dU = torch.mm(g.t(), dy2)
        xt = x2.t()
        if dab is not None:
            dwv = torch.bmm(xt.unsqueeze(0).expand(2, *xt.shape), dab)
            dW, dV = dwv[0], dwv[1]
        else:
            dV = torch.mm(xt, db)
            dW = torch.mm(xt, da)
        dx = torch.mm(db, V.t())
        dx.addmm_(da, W.t())
        return dx.view(x.shape), dW, dV, dU, None


SEL = {}


class ProtoMLP(nn.Module):
    def __init__(self, h, i, mode, dtype):
        super().__init__()
        kw = {"device": dev, "dtype": dtype}
        if mode == "jit":
            self.W = nn.Parameter(torch.empty(h, i, **kw))
            self.V = nn.Parameter(torch.empty(h, i, **kw))
        else:
            wv = torch.empty(2, h, i, **kw)
            self.W, self.V = nn.Parameter(wv[0]), nn.Parameter(wv[1])
        self.U = nn.Parameter(torch.empty(i, h, **kw))
        for p in (self.W, self.V, self.U):
            nn.init.uniform_(p, -1 / math.sqrt(p.shape[0]), 1 / math.sqrt(p.shape[0]))
        self.mode = mode

    def forward(self, x):
        return Proto.apply(x, self.W, self.V, self.U, self.mode)


def build(variant, b, s, h, i, layers, dtype):
    torch.manual_seed(0)
    if variant == "reference":
        mods = [SwigluMLP(h, i, device=dev, dtype=dtype) for _ in range(layers)]
    elif variant == "lib":
        mods = [MemoryOptimizedSwigluMLP(h, i, 0, device=dev, dtype=dtype) for _ in range(layers)]
    else:
        mods = [ProtoMLP(h, i, variant, dtype) for _ in range(layers)]
    model = MLPStack(mods, residual=True)
    x = torch.randn(b, s, h, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn(b, s, h, device=dev, dtype=dtype)
    return model, x, dy


def steps(model, x, dy, n):
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        x.grad = None
        model(x).backward(dy)


def gemm_cases(x2, wv, dab):
    xe = x2.unsqueeze(0).expand(2, *x2.shape)
    xte = x2.t().unsqueeze(0).expand(2, *x2.t().shape)
    return {
        "fwd 2 mm": lambda: (torch.mm(x2, wv[0]), torch.mm(x2, wv[1])),
        "fwd bmm": lambda: torch.bmm(xe, wv),
        "dW,dV 2 mm": lambda: (torch.mm(x2.t(), dab[0]), torch.mm(x2.t(), dab[1])),
        "dW,dV bmm": lambda: torch.bmm(xte, dab),
    }


VARIANTS = ["reference", "lib", "jit", "jit_bmm", "torch_bmm2", "sel_bmm2"]
CONFIGS = [(16, 128, 512, 2048, 2), (32, 128, 512, 2048, 2), (8, 512, 1024, 4096, 3)]
ROUNDS = 15
GEMM_SHAPES = [(2048, 512, 2048), (4096, 1024, 4096), (4096, 4096, 16384), (8192, 4096, 16384)]
GEMM_REPS = 30


def check_prototypes(log: RunLog) -> None:
    """Each prototype against the reference module in fp32 (one layer): max abs error of the
    output and every gradient, and whether dW and dV share one storage."""
    for variant in VARIANTS[2:]:
        torch.manual_seed(0)
        ref = SwigluMLP(64, 160, device=dev, dtype=torch.float32)
        proto = ProtoMLP(64, 160, variant, torch.float32)
        SEL[torch.float32] = torch.tensor([0.0, 1.0], device=dev).view(2, 1, 1)
        with torch.no_grad():
            proto.W.copy_(ref.W.weight.t())
            proto.V.copy_(ref.V.weight.t())
            proto.U.copy_(ref.U.weight.t())
        x = torch.randn(3, 7, 64, device=dev, requires_grad=True)
        y_ref = ref(x)
        gy = torch.randn_like(y_ref)
        (gx_ref,) = torch.autograd.grad(y_ref, x, gy, retain_graph=True)
        y = proto(x)
        y.backward(gy)
        err = max((y - y_ref).abs().max().item(), (x.grad - gx_ref).abs().max().item())
        ref.zero_grad()
        y_ref.backward(gy)
        err = max(
            err,
            (proto.W.grad - ref.W.weight.grad.t()).abs().max().item(),
            (proto.V.grad - ref.V.weight.grad.t()).abs().max().item(),
            (proto.U.grad - ref.U.weight.grad.t()).abs().max().item(),
        )
        shared = (
            proto.W.grad.untyped_storage().data_ptr() == proto.V.grad.untyped_storage().data_ptr()
        )
        config = {"kind": "check", "dtype": "fp32", "hidden_dim": 64, "intermediate_size": 160}
        log.log(
            variant,
            {**config, "num_layers": 1},
            {"max_abs_err_vs_reference": err, "w_grad_shares_storage_with_v_grad": shared},
        )
        print(f"check {variant:10s} max abs err vs reference (fp32): {err:.2e}; shared: {shared}")


def time_config(log: RunLog, cfg: tuple[int, ...], dtype: torch.dtype) -> None:
    """Every variant alive at once, interleaved rounds of chunks; peak memory of one step each."""
    b, s, h, i, layers = cfg
    alive = {v: build(v, *cfg, dtype) for v in VARIANTS}
    peaks, per_step = {}, {}
    for v, (m, x, dy) in alive.items():
        steps(m, x, dy, 3)
        torch.cuda.synchronize()
        others = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        steps(m, x, dy, 1)
        torch.cuda.synchronize()
        peaks[v] = (torch.cuda.max_memory_allocated() - others) / 2**20
        t0 = time.perf_counter()
        steps(m, x, dy, 20)
        torch.cuda.synchronize()
        per_step[v] = (time.perf_counter() - t0) / 20
    n = {v: max(5, math.ceil(2.5 / per_step[v] / ROUNDS)) for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    for rnd in range(-1, ROUNDS):  # round -1 is a warm-up
        shift = max(rnd, 0) % len(VARIANTS)
        for v in VARIANTS[shift:] + VARIANTS[:shift]:
            m, x, dy = alive[v]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            steps(m, x, dy, n[v])
            torch.cuda.synchronize()
            if rnd >= 0:
                times[v].append((time.perf_counter() - t0) / n[v])
    ref_t = st.median(times["reference"])
    config = {
        "kind": "step",
        "batch_size": b,
        "seq_len": s,
        "hidden_dim": h,
        "intermediate_size": i,
        "num_layers": layers,
        "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
        "rounds": ROUNDS,
    }
    print(f"\n=== {b}x{s} h{h} i{i} L{layers} {config['dtype']}")
    for v in VARIANTS:
        med = st.median(times[v])
        q = sorted(times[v])
        metrics = {
            "step_ms_median": med * 1e3,
            "step_ms_q25": q[len(q) // 4] * 1e3,
            "step_ms_q75": q[3 * len(q) // 4] * 1e3,
            "step_over_reference": med / ref_t,
            "peak_mib": peaks[v],
            "peak_over_reference": peaks[v] / peaks["reference"],
        }
        log.log(v, config, metrics)
        print(f"{v:11s} " + "  ".join(f"{k} {x:.3f}" for k, x in metrics.items()))
    del alive
    torch.cuda.empty_cache()


def time_gemms(log: RunLog) -> None:
    """The input GEMMs alone: two mm against one bmm over stacked (2, H, I) weights, ms (median
    of GEMM_REPS CUDA-event timings)."""
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for n_tok, h, i in GEMM_SHAPES:
            if dt == torch.float32 and n_tok * h * i > 4096 * 4096 * 16384:
                continue
            x2 = torch.randn(n_tok, h, device=dev, dtype=dt)
            wv = torch.randn(2, h, i, device=dev, dtype=dt) / math.sqrt(h)
            dab = torch.randn(2, n_tok, i, device=dev, dtype=dt)
            expanded = torch.bmm(x2.unsqueeze(0).expand(2, n_tok, h), wv)[1]
            diff = (expanded - torch.mm(x2, wv[1])).abs().max().item()
            res = {}
            for k, f in gemm_cases(x2, wv, dab).items():
                for _ in range(5):
                    f()
                ts = []
                for _ in range(GEMM_REPS):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    f()
                    e1.record()
                    e1.synchronize()
                    ts.append(e0.elapsed_time(e1))
                res[k] = st.median(ts)
            config = {
                "kind": "gemm",
                "dtype": tag,
                "tokens": n_tok,
                "hidden_dim": h,
                "intermediate_size": i,
                "reps": GEMM_REPS,
            }
            metrics = {
                "fwd_2mm_ms": res["fwd 2 mm"],
                "fwd_bmm_ms": res["fwd bmm"],
                "dw_dv_2mm_ms": res["dW,dV 2 mm"],
                "dw_dv_bmm_ms": res["dW,dV bmm"],
                "bmm_over_mm_fwd": res["fwd bmm"] / res["fwd 2 mm"],
                "bmm_over_mm_bwd": res["dW,dV bmm"] / res["dW,dV 2 mm"],
                "bmm_mm_max_diff": diff,
            }
            log.log("gemms", config, metrics)
            print(
                f"{tag} N{n_tok} H{h} I{i}: "
                + "  ".join(f"{k} {v:.3f}" for k, v in metrics.items())
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/swiglu/probes"), help="log folder")
    args = p.parse_args()
    log = RunLog(args.out / "fewer_launches.jsonl", task="swiglu", create=True)
    SEL[torch.bfloat16] = torch.tensor([0.0, 1.0], device=dev, dtype=torch.bfloat16).view(2, 1, 1)
    check_prototypes(log)
    for cfg in CONFIGS:
        time_config(log, cfg, torch.bfloat16)
    time_gemms(log)


if __name__ == "__main__":
    main()
