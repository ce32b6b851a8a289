"""Loads the LM-training logs (reports/results/lm_training/) for lm_training.ipynb.

Builds what the report's sections read: the one-GPU run summaries, steps and evals of train.py;
the data deliverables (D1-D4); Deliverable 5's settings against the baseline; the feed-forward
GEMMs of one layer from the profiler trace (D6); the multi-GPU logs (1, 2 and 4 GPUs, the 8B
model beside torchtitan, the checkpoint resume, DDP on 2 GPUs); the MFU target's runs;
the provenance table; and the answers and targets of the report's first two tables. It displays nothing: the
notebook runs it with ``%run -i`` and shows the tables.
"""

import gzip
import json
import re

import pandas as pd
from loaders.replicates import (  # reports/loaders/ (cwd: reports/)
    envs_by_log,
    frame_envs,
    log_provenance,
)

from effdl.answers import Answer, Target
from effdl.models.llama import TransformerModelArgs, ffn_hidden_dim
from effdl.profiling.timing import median_ratio_ci
from effdl.results import device_name, load_results, results_dir
from effdl.tables import measured

RESULTS = results_dir("results")
LM = RESULTS / "lm_training"
NOT_MEASURED = "not measured"
DATASHEET_TFLOPS = 989.0  # H100 / H200 SXM dense bf16, NVIDIA datasheets (the seed's figure)
# HBM bandwidth per GPU model, NVIDIA datasheets (SXM parts); the seed quotes 4 TB/s.
DATASHEET_HBM_TB_S = {"NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H200": 4.8}
SEED_HBM_TB_S = 4.0


def ridge(hbm_tb_s):
    """The roofline ridge in FLOP/B, defined as in gpu_ceilings.ipynb: the datasheet dense bf16
    peak over the datasheet HBM bandwidth of the GPU the kernels ran on."""
    return DATASHEET_TFLOPS / hbm_tb_s


TARGET_MFU = {2048: 0.55, 4096: 0.50}
TARGET_2GPU, TARGET_8B_MFU, TARGET_VS_TITAN = 1.85, 0.45, 1.15
TARGET_PER_GPU = {2: 0.95, 4: 0.93}
HEADROOM = 0.9  # peak memory below 90% of the card
CAPACITY_GIB = {"NVIDIA H200": 143771 / 1024, "NVIDIA H100 80GB HBM3": 81559 / 1024}  # nvidia-smi
S_DATA = "Data and the 8B parameter count (Deliverables 1-4)"
S_SPEED = "Throughput of each setting (Deliverable 5)"
S_MFU = "MFU of the 1B model at larger batches"
S_GEMM = "The feed-forward GEMMs of one layer (Deliverable 6)"
S_8B = "Llama 8B beside torchtitan on 4 GPUs"
S_SCALE = "The 1B model on 1, 2 and 4 GPUs"
S_DDP = "Where DDP on 2 GPUs loses time"
S_CKPT = "Activation checkpointing and checkpoint resume"
S_REP = "Appendix: the same ratios on other hosts"


def load(pattern):
    try:
        return load_results(LM, pattern=pattern)
    except FileNotFoundError:
        return None


def pct(x):
    return NOT_MEASURED if x is None or pd.isna(x) else f"{x:.1%}"


def shape_text(args):
    """A model's shape from a run's logged ``config.model_args``."""
    ffn = ffn_hidden_dim(TransformerModelArgs(**args))
    return (
        f"dim {args['dim']}, {args['n_layers']} layers, {args['n_heads']} heads, "
        f"{args['n_kv_heads']} KV heads, FFN {ffn}, vocabulary {args['vocab_size']}"
    )


def setup_text(frame):
    """Sequence length and batch per GPU of a frame's runs, from their configs."""

    def values(key):
        return "/".join(str(int(v)) for v in sorted(frame[f"config.{key}"].dropna().unique()))

    return f"seq {values('sequence_length')}, batch {values('batch_size')} per GPU"


# lm_training_stages.ipynb reads these logs
OTHER_STUDIES = ("layer_norm_benchmark", "layer_norm_ablation", "speedup_stages")
SEVERAL_GPUS = "llama"  # the multi-GPU logs: llama8b_*, llama1b_*
EACH_ALONE = "llama1b_settings_each_alone"  # Deliverable 5's settings, each alone (one GPU)
runs = load("*.jsonl")
if runs is not None:
    runs = runs[
        (runs["task"] == "lm_training")
        & ~runs["source"].str.startswith((*OTHER_STUDIES, SEVERAL_GPUS))
    ]
if runs is None or "metrics.step" not in runs:
    raise FileNotFoundError(f"no lm_training run logs under {LM} (make demo-lm writes them)")
deliv = runs[runs["variant"].isin(["first_sample", "batch_padded", "batch_packed", "params_8b"])]
train = runs[~runs.index.isin(deliv.index)]
summ = train[train["variant"].str.endswith("_summary")].copy()
summ["run"] = summ["variant"].str.removesuffix("_summary")
steps = train[train["variant"].isin(summ["run"])]
evals = train[train["variant"].str.endswith("_eval")]
data_rec = train[train["variant"].str.endswith("_data")]
ON_GPU = summ["env.gpu"].notna().any()
# the device that ran: the first GPU of the logs, or the CPU where no run had one
GPU = device_name(summ[summ["env.gpu"].notna()].iloc[0] if ON_GPU else summ.iloc[0])
LOGS = sorted(set(runs["source"]))  # the one-GPU run logs read as runs

# Deliverables 1-4
D = {r["variant"]: r for _, r in deliv.iterrows()}


# Deliverable 5: each setting alone against the baseline at the same batch, from its own log where
# present, else from the one-GPU study (the host that ran its baseline).
def flag(frame, key):
    return frame[f"config.{key}"].fillna(False).astype(bool)


alone_log = load(f"{EACH_ALONE}*.jsonl")
ALONE_SUMM = (
    summ.iloc[:0] if alone_log is None else alone_log[alone_log["variant"].str.endswith("_summary")]
)
d5_src = summ if alone_log is None else ALONE_SUMM
d5_src = d5_src[
    (d5_src["config.grad_accumulation"].fillna(1) == 1)
    & (d5_src["config.precision"].fillna("autocast") == "autocast")
    & ~flag(d5_src, "profile")
    & (d5_src["config.parallel"].fillna("none") == "none")
]
plain = d5_src[~flag(d5_src, "fused_optimizer") & ~flag(d5_src, "compile")]
BASE = None
if len(plain):
    plain = plain[plain["config.n_params"] == plain["config.n_params"].max()]
    plain = plain[plain["config.sequence_length"] == plain["config.sequence_length"].min()]
    BASE = plain.iloc[-1]
    d5_src = d5_src[
        (d5_src["config.model"] == BASE["config.model"])
        & (d5_src["env.gpu_id"].fillna("CPU") == (BASE.get("env.gpu_id") or "CPU"))
    ]
SETTINGS = [  # label, fused, compile, sequence x baseline's, batch / baseline's, the mechanism
    ("baseline", False, False, 1, 1, "AdamW (foreach), eager model, autocast bf16 over fp32 weights"),
    ("--fused-optimizer", True, False, 1, 1,
     "the AdamW update runs as one fused kernel set instead of one multi-tensor kernel per "
     "elementwise op: fewer passes over the fp32 weights, gradients and moments"),
    ("--compile", False, True, 1, 1,
     "Inductor fuses RMSNorm, RoPE, SiLU x up, residual adds and casts into Triton kernels: "
     "fewer HBM round trips and fewer saved activations"),
    ("--sequence-length 4096, same batch", False, False, 2, 1,
     "twice the tokens per step and per activation; the causal attention FLOPs per token grow "
     "with the sequence"),
    ("--sequence-length 4096, same tokens per step", False, False, 2, 2,
     "the same tokens per step at half the batch: each token attends over twice the context, "
     "more attention FLOPs per token at about the same activation memory"),
    ("--fused-optimizer --compile", True, True, 1, 1, "both savings together"),
    ("--fused-optimizer --compile --sequence-length 4096, same tokens", True, True, 2, 2,
     "the longer sequence on top of both"),
]  # fmt: skip
d5 = []
for lab, fu, co, sx, bx, why in SETTINGS:
    r = None
    if BASE is not None:
        m = d5_src[
            (flag(d5_src, "fused_optimizer") == fu)
            & (flag(d5_src, "compile") == co)
            & (d5_src["config.sequence_length"] == BASE["config.sequence_length"] * sx)
            & (d5_src["config.batch_size"] * bx == BASE["config.batch_size"])
        ]
        r = m.iloc[-1] if len(m) else None
    tps = None if r is None else r["metrics.tokens_per_s"]
    x = None if r is None else tps / BASE["metrics.tokens_per_s"]
    d5.append(
        {
            "setting": lab,
            "seq x batch": NOT_MEASURED if r is None
            else f"{int(r['config.sequence_length'])} x {int(r['config.batch_size'])}",
            "tokens/s": tps,
            "x baseline": x,
            "MFU": None if r is None else r.get("metrics.mfu"),
            "peak GiB": None if r is None else r.get("metrics.peak_gib"),
            "FLOPs/token x baseline": None if r is None
            else r["config.flops_per_token"] / BASE["config.flops_per_token"],
            "why": why,
        }
    )  # fmt: skip
d5 = pd.DataFrame(d5).set_index("setting")


def d5_answer(lab):
    r = d5.loc[lab]
    if pd.isna(r["tokens/s"]):
        return NOT_MEASURED
    said = f"{r['tokens/s']:,.0f} tokens/s, MFU {pct(r['MFU'])}, peak {measured(r['peak GiB'], '.1f', ' GiB')}"
    if lab == "baseline":
        return said + f" ({r['seq x batch']}, {device_name(BASE)})"
    word = "faster" if r["x baseline"] >= 1 else "slower"
    return f"{r['x baseline']:.2f}x the baseline ({word}); " + said


# Deliverable 6: the feed-forward GEMMs of one layer from the profiler trace
traces = sorted(LM.glob("traces/trace_*.json*"))
gemms = g = None
TRACE_GPU = HBM_TB_S = RIDGE = None
if traces:
    path = traces[0]
    # the run that wrote the trace names its GPU: train.py --name <run> writes trace_<run>.json.gz
    traced = summ[summ["run"] == path.name.split(".")[0].removeprefix("trace_")]
    TRACE_GPU = device_name(traced.iloc[0] if len(traced) else summ.iloc[0])
    HBM_TB_S = DATASHEET_HBM_TB_S.get(TRACE_GPU)  # None on a CPU or another GPU model
    RIDGE = ridge(HBM_TB_S) if HBM_TB_S else None
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        trace = json.load(f)
    ev_x = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    kernels = {e["args"]["correlation"]: e for e in ev_x if e.get("cat") == "kernel"}
    launches = [
        e
        for e in ev_x
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    ]
    cpu_ops = [e for e in ev_x if e.get("cat") == "cpu_op"]
    annotations = [e for e in ev_x if e.get("cat") == "user_annotation"]
    PROFILED_STEPS = sum(e["name"].startswith("ProfilerStep#") for e in annotations)
    GEMM = re.compile(r"nvjet|gemm|cutlass|xmma", re.I)

    def inside(outer, e):
        return e["tid"] == outer["tid"] and outer["ts"] <= e["ts"] <= outer["ts"] + outer["dur"]

    def gemm_kernels(op):
        return [
            kernels[c]
            for lnch in launches
            if inside(op, lnch)
            and (c := lnch["args"]["correlation"]) in kernels
            and GEMM.search(kernels[c]["name"])
        ]

    mm_backward = {}
    for e in cpu_ops:
        if e["name"] == "MmBackward0":
            mm_backward.setdefault(e["args"].get("Sequence number"), []).append(e)
    found = []
    for r in annotations:
        if not re.fullmatch(r"L\d+\.ffn\.w\d_\w+", r["name"]):
            continue
        layer, gemm = r["name"].split(".", 1)
        for mm in (o for o in cpu_ops if o["name"] == "aten::mm" and inside(r, o)):
            for k in gemm_kernels(mm):
                found.append((layer, gemm, "forward", mm["args"]["Input Dims"], k))
            for bw in mm_backward.get(mm["args"].get("Sequence number"), []):
                for bmm in (o for o in cpu_ops if o["name"] == "aten::mm" and inside(bw, o)):
                    for k in gemm_kernels(bmm):
                        found.append((layer, gemm, "backward", bmm["args"]["Input Dims"], k))
    gemms = pd.DataFrame(
        [
            {"layer": lay, "gemm": gm, "pass": p, "m": d[0][0], "k": d[0][1], "n": d[1][1],
             "kernel": k["name"], "us": k["dur"], "ts": k["ts"]}
            for lay, gm, p, d, k in found
        ]
    )  # fmt: skip
if gemms is not None and len(gemms):
    g = (
        gemms.groupby(["gemm", "pass", "m", "k", "n", "kernel"], sort=False)["us"]
        .agg(["median", "count"])
        .reset_index()
    )
    g["GFLOP"] = 2 * g["m"] * g["k"] * g["n"] / 1e9
    g["MB moved"] = 2 * (g["m"] * g["k"] + g["k"] * g["n"] + g["m"] * g["n"]) / 1e6
    g["TFLOP/s"] = g["GFLOP"] / g["median"] * 1e3
    g["% of 989"] = g["TFLOP/s"] / DATASHEET_TFLOPS
    g["us at 4 TB/s"] = g["MB moved"] / SEED_HBM_TB_S  # the seed's bandwidth: the memory floor
    g["FLOP/byte"] = g["GFLOP"] * 1e3 / g["MB moved"]
    g["bound"] = ["compute" if x > ridge(SEED_HBM_TB_S) else "memory" for x in g["FLOP/byte"]]
    fw = g[g["pass"] == "forward"]

# Several GPUs: the 1, 2 and 4-GPU study, the 8B model and the DDP, checkpoint and resume logs
multi = load(f"{SEVERAL_GPUS}*.jsonl")
if multi is not None:
    multi = multi[~multi["source"].str.startswith(EACH_ALONE)]
    multi = multi if len(multi) else None
SCALING_LOG = "llama1b_scaling_1_2_4_gpus"


def plain_1b(frame):
    """The 1B summaries of full, unprofiled runs without activation checkpointing."""
    s = frame[frame["variant"].str.endswith("_summary") & (frame["task"] == "lm_training")]
    return s[
        (s["config.model"] == "1b") & s["config.resume"].isna() & (s["config.stop_after"] == 0)
        & (s["config.activation_checkpoint"] == "none") & (s["config.grad_accumulation"] == 1)
        & s["config.nccl_max_ctas"].isna() & (s["config.ddp_bucket_mb"] == 200)
    ]  # fmt: skip


SCALING = pd.DataFrame()
if multi is not None:
    ms = plain_1b(multi[multi["source"].str.startswith(SCALING_LOG)])
    ms = ms[~ms["config.profile"].astype(bool)]
    SCALING = pd.DataFrame(
        {
            "GPU": ms["env.gpu"],
            "parallel": ms["config.parallel"].where(ms["config.parallel"] != "none", "one GPU"),
            "precision": ms["config.precision"],
            "GPUs": ms["config.world"].astype(int),
            "tokens/s": ms["metrics.tokens_per_s"],
            "peak GiB": ms["metrics.peak_gib"],
        }
    )
    SCALING["tokens/s per GPU"] = SCALING["tokens/s"] / SCALING["GPUs"]
    one = SCALING.loc[SCALING["parallel"] == "one GPU", "tokens/s per GPU"].iloc[0]
    SCALING["x one GPU"] = SCALING["tokens/s"] / one
    SCALING["per GPU vs one"] = SCALING["tokens/s per GPU"] / one
    SCALING = SCALING.sort_values(["GPUs", "parallel"]).reset_index(drop=True)
    H200_HOST = ms["env.gpu_id"].iloc[0]


def scaled(parallel, gpus):
    r = (
        SCALING[(SCALING["parallel"] == parallel) & (SCALING["GPUs"] == gpus)]
        if len(SCALING)
        else SCALING
    )
    return r.iloc[0] if len(r) else None


# The 8B model beside torchtitan; the checkpoint resume
ours8 = titan = None
if multi is not None:
    o8 = multi[(multi["task"] == "lm_training") & (multi["config.model"] == "8b")]
    o8 = o8[o8["variant"].str.endswith("_summary") & o8["config.resume"].isna()]
    ours8 = o8.iloc[0] if len(o8) else None
    t8 = multi[(multi["task"] == "torchtitan_peer") & (multi["variant"] == "torchtitan_summary")]
    titan = t8.iloc[0] if len(t8) else None


def loss_curve(df):
    s = df[df["metrics.loss"].notna() & df["metrics.step"].notna()]
    return s.set_index(s["metrics.step"].astype(int))["metrics.loss"]


RESUME = None
AC = None
if multi is not None:
    # The resume study and the activation-checkpoint policies ran on other GPUs than the scaling
    # study: each comparison below says which runs it sets side by side.
    lm = multi[multi["task"] == "lm_training"]
    fsdp4 = lm[
        (lm["config.model"] == "1b") & (lm["config.world"] == 4) & (lm["config.parallel"] == "fsdp")
    ]
    no_ac = fsdp4[fsdp4["config.activation_checkpoint"] == "none"]
    whole_runs = no_ac[(no_ac["config.stop_after"] == 0) & no_ac["config.resume"].isna()
                       & no_ac["source"].str.startswith(SCALING_LOG)]  # fmt: skip
    first_runs = no_ac[no_ac["config.stop_after"] > 0]
    resumed_runs = no_ac[no_ac["config.resume"].notna()]
    whole, first, resumed = loss_curve(whole_runs), loss_curve(first_runs), loss_curve(resumed_runs)
    if len(whole) and len(first) and len(resumed):
        RESUME = {
            "at": int(resumed.index.min()),
            "last": int(resumed.index.max()),
            "gap": (resumed - whole.loc[resumed.index]).abs().max(),
            "noise": (first - whole.loc[first.index]).abs().max(),
            "first": (int(first.index.min()), int(first.index.max())),
            "same_gpus": set(whole_runs["env.gpu_id"]) == set(resumed_runs["env.gpu_id"]),
        }

    # Activation checkpointing: every policy against the no-recomputation run of its own host. Where
    # that host has no full run without recomputation, the first part of the resume study (same
    # settings, stopped after --stop-after steps) is the baseline, timed over fewer steps.
    s4 = fsdp4[fsdp4["variant"].str.endswith("_summary") & fsdp4["config.resume"].isna()]
    policies = s4[(s4["config.activation_checkpoint"] != "none") & (s4["config.stop_after"] == 0)]
    if len(policies):
        host = policies["env.gpu_id"].iloc[0]
        same = s4[(s4["env.gpu_id"] == host) & (s4["config.activation_checkpoint"] == "none")]
        base = same.sort_values("config.stop_after", key=lambda c: c == 0, ascending=False).head(1)
        rows = pd.concat([base, policies[policies["env.gpu_id"] == host]])
        AC = pd.DataFrame(
            {
                "policy": rows["config.activation_checkpoint"],
                "blocks recomputed": rows["config.activation_checkpoint"].map(
                    lambda p: {"none": "none", "full": "all", "op": "all, op-level"}.get(
                        p, f"every {p.split(':')[-1]}-th"
                    )
                ),
                "timed steps": rows["metrics.timed_steps"].astype(int),
                "tokens/s per GPU": rows["metrics.tokens_per_s"] / 4,
                "peak GiB": rows["metrics.peak_gib"],
            }
        ).drop_duplicates("policy")
        if len(base):
            AC["speed vs none"] = AC["tokens/s per GPU"] / AC["tokens/s per GPU"].iloc[0]
            AC["memory vs none"] = AC["peak GiB"] / AC["peak GiB"].iloc[0]
        AC_ROWS = rows
        AC_BASE_PARTIAL = bool(len(base) and base["config.stop_after"].iloc[0] > 0)
        # Two same-host runs of the no-recomputation settings (first part and resumed part of the
        # resume study): their spread is the speed noise that a policy's ratio must exceed.
        pair = fsdp4[fsdp4["variant"].str.endswith("_summary") & (fsdp4["env.gpu_id"] == host)
                     & (fsdp4["config.activation_checkpoint"] == "none")]  # fmt: skip
        AC_NOISE = (
            pair["metrics.tokens_per_s"].max() / pair["metrics.tokens_per_s"].min()
            if len(pair) > 1
            else None
        )


# The 1B model's MFU target, per sequence length: the bf16-params + fp32-masters run with the most
# tokens per optimizer step (a fixed rule, not the best MFU of several runs).
mfu_runs = summ[(summ["config.precision"] == "master") & ~flag(summ, "profile")]
MFU_RUN = {}
for seq in TARGET_MFU:
    r = mfu_runs[mfu_runs["config.sequence_length"] == seq]
    if len(r):
        MFU_RUN[seq] = r.iloc[(r["config.batch_size"] * r["config.grad_accumulation"]).argmax()]


def mfu_target(seq):
    what = f"1B MFU >= {TARGET_MFU[seq]:.0%} at seq {seq} (one H100)"
    r = MFU_RUN.get(seq)
    if r is None:
        return Target(what, None, None)
    on_h100 = "H100" in device_name(r)
    return Target(
        what,
        f"{r['metrics.mfu']:.1%} on one {device_name(r)}; batch {int(r['config.batch_size'])} x "
        f"{int(r['config.grad_accumulation'])} micro-batches, bf16 params + fp32 masters, fused "
        "AdamW, compile" + ("" if on_h100 else "; no H100 run of this setting"),
        bool(r["metrics.mfu"] >= TARGET_MFU[seq]) if on_h100 else None,
    )


# DDP on 2 GPUs against one GPU: tokens/s from each run's timed steps, with a 90% interval
def timed_steps(frame, summary):
    s = frame[(frame["variant"] == summary["variant"].removesuffix("_summary"))
              & (frame["env.run_id"] == summary["env.run_id"])]  # fmt: skip
    return list(s.loc[s["metrics.step"] >= summary["config.timing_warmup"], "metrics.step_s"])


def embedding_sync(frame):
    """How each run's DDP averaged the embedding's gradient (logs without the field: whole)."""
    if "config.ddp_embedding" not in frame:
        return pd.Series("dense", index=frame.index)
    return frame["config.ddp_embedding"].fillna("dense")


def timed_runs(frame):
    """:func:`plain_1b`'s runs of a log, the unprofiled ones where it has any."""
    p = plain_1b(frame)
    unprofiled = p[~p["config.profile"].astype(bool)]
    return unprofiled if len(unprofiled) else p


def ddp2_ratio(frame, embedding):
    """(one GPU, DDP on 2) summaries of one host's log, DDP (the embedding's gradient averaged
    ``embedding``: dense or rows) over one GPU's tokens/s and its 90% interval; where the log
    has one GPU before and after, their mean rate and their timed steps pooled."""
    p = timed_runs(frame)
    one = p[(p["config.world"] == 1) & (p["config.parallel"] == "none")]
    two = p[(p["config.parallel"] == "ddp") & (p["config.world"] == 2)]
    if "config.ddp_reduce" in two:
        two = two[two["config.ddp_reduce"].fillna("fp32") == "fp32"]
    two = two[embedding_sync(two) == embedding]
    if not len(one) or not len(two):
        return None
    b = two.iloc[0]
    x = b["metrics.tokens_per_s"] / one["metrics.tokens_per_s"].mean()
    one_steps = [t for _, a in one.iterrows() for t in timed_steps(frame, a)]
    lo, hi = median_ratio_ci(one_steps, timed_steps(frame, b))
    return one.iloc[0], b, x, 2 * lo, 2 * hi


DDP2 = {}  # (log, the embedding's averaging) -> ddp2_ratio's tuple
if multi is not None:
    for src, frame in multi.groupby("source"):
        for embedding in ("dense", "rows"):
            got = ddp2_ratio(frame, embedding)
            if got is not None:
                DDP2[src, embedding] = got
# The headline: the README's command as it stands (the embedding's looked-up rows averaged)
# where that run exists, else the scaling study's DDP run.
EMBEDDING_LOG = "llama1b_ddp2_embedding"
ddp_main_key = next((k for k in DDP2 if k[0].startswith(EMBEDDING_LOG) and k[1] == "rows"),
                    next((k for k in DDP2 if k[0].startswith(SCALING_LOG)), None))  # fmt: skip
ddp_main = DDP2.get(ddp_main_key)


def embedding_comparison():
    """One GPU and DDP on 2 with the embedding's gradient averaged whole and row-wise, from
    the embedding log: tokens/s, x one GPU (90% interval), step ms; and per profiled step the
    collectives no kernel hides, the GPU's idle time and its copy/fill kernels."""
    if multi is None:
        return None
    log = multi[multi["source"].str.startswith(EMBEDDING_LOG)]
    if not len(log):
        return None
    summaries = timed_runs(log)
    kernels = log[log["variant"].str.endswith("_kernels")]
    rows = {}
    for embedding in ("dense", "rows"):
        got = DDP2.get((log["source"].iloc[0], embedding))
        if got is None:
            continue
        _, b, x, lo, hi = got
        if "one GPU" not in rows:
            ones = summaries[summaries["config.parallel"] == "none"]
            rows["one GPU"] = {"tokens/s": ones["metrics.tokens_per_s"].mean(), "x one GPU": 1.0,
                               "90% interval": "", "step ms": 1e3 * ones["metrics.step_s"].mean()}  # fmt: skip
        name = f"DDP 2 GPUs, embedding {'rows looked up' if embedding == 'rows' else 'whole'}"
        rows[name] = {"tokens/s": b["metrics.tokens_per_s"], "x one GPU": x,
                      "90% interval": f"{lo:.3f}-{hi:.3f}", "step ms": 1e3 * b["metrics.step_s"]}  # fmt: skip
        k = kernels[(kernels["config.world"] == 2) & (embedding_sync(kernels) == embedding)]
        if len(k):
            k = k.iloc[0]
            n = k["metrics.profile_steps"]
            rows[name]["collectives no kernel hides, ms/step"] = (
                k["metrics.communication_exposed_ms"] / n
            )
            rows[name]["GPU idle, ms/step"] = k["metrics.idle_ms"] / n
            rows[name]["copy/fill, ms/step"] = k["metrics.by_kind_ms"].get("copy/fill", 0.0) / n
    return (pd.DataFrame(rows).T, log) if rows else None


EMBEDDING_ROWS = embedding_comparison()


def span(values, spec=".0f"):
    lo, hi = format(values.min(), spec), format(values.max(), spec)
    return lo if lo == hi else f"{lo}-{hi}"


answers = []
if D:
    f1, pad, pack, p8 = D["first_sample"], D["batch_padded"], D["batch_packed"], D["params_8b"]
    text = re.sub(r"\*{2,}", "", " ".join(str(f1["metrics.decoded"]).split()))
    text = text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")
    answers += [
        Answer("D1: first 200 tokens of the first sample, decoded",
               f"\"{text[:70]}...\" ({int(f1['metrics.n_tokens'])} tokens, {f1['config.data_name']}, our BPE)", S_DATA),
        Answer(f"D2: tokens in a padded {int(pad['metrics.batch'])} x {int(pad['config.sequence_length'])} batch, ignored",
               f"{int(pad['metrics.tokens']):,} label tokens, {int(pad['metrics.ignored']):,} ignored "
               f"({pad['metrics.ignored_fraction']:.1%})", S_DATA),
        Answer("D2: why that is a problem",
               f"{pad['metrics.ignored_fraction']:.0%} of the batch's compute and memory go to padding; the "
               f"packed IterableParquetDataset ignores {int(pack['metrics.ignored']):,} "
               f"({pack['metrics.ignored_fraction']:.2%})", S_DATA),
        Answer("D3: IterableParquetDataset", "effdl/data/iterable_parquet.py (the class alone)", S_DATA),
        Answer("D4: parameter count of the 8B configuration",
               f"{int(p8['metrics.from_model']):,} (model and closed form "
               f"{'agree' if int(p8['metrics.from_model']) == int(p8['metrics.closed_form']) else 'differ'})", S_DATA),
    ]  # fmt: skip
answers += [Answer(f"D5: {lab}", d5_answer(lab), S_SPEED) for lab, *_ in SETTINGS[:5]]
if g is not None:
    answers += [
        Answer("D6: the 3 FFN GEMMs of a layer (CPU + GPU timeline) against 989 TFLOP/s",
               f"forward {fw['median'].min():.0f}-{fw['median'].max():.0f} us each at {fw['TFLOP/s'].min():.0f}-"
               f"{fw['TFLOP/s'].max():.0f} TFLOP/s ({fw['% of 989'].min():.0%}-{fw['% of 989'].max():.0%}); "
               f"{fw['GFLOP'].iloc[0] / DATASHEET_TFLOPS * 1e3:.0f} us each at 989", S_GEMM),
        Answer("D6: against 4 TB/s",
               f"{span(fw['FLOP/byte'])} FLOP/B, above the ridge of 989 TFLOP/s / 4 TB/s = "
               f"{ridge(SEED_HBM_TB_S):.0f} FLOP/B: compute-bound; their minimum traffic takes "
               f"{fw['us at 4 TB/s'].iloc[0]:.0f} us at 4 TB/s ({TRACE_GPU})", S_GEMM),
    ]  # fmt: skip
else:
    answers.append(
        Answer("D6: FFN GEMMs against 989 TFLOP/s and the bandwidth", NOT_MEASURED, S_GEMM)
    )


# The project's own targets (the report's second table)
targets = [mfu_target(2048), mfu_target(4096)]
if ours8 is not None:
    targets.append(Target(f"8B MFU >= {TARGET_8B_MFU:.0%} per GPU (FSDP2, 4 GPUs)",
                          f"{ours8['metrics.mfu']:.1%}", bool(ours8["metrics.mfu"] >= TARGET_8B_MFU)))  # fmt: skip
    if titan is not None:
        vs = (
            ours8["metrics.tokens_per_s"]
            / ours8["config.world"]
            / titan["metrics.tokens_per_s_per_gpu"]
        )
        targets.append(Target(f"8B tokens/s per GPU >= {TARGET_VS_TITAN}x torchtitan's (same GPUs)",
                              f"{vs:.2f}x", bool(vs >= TARGET_VS_TITAN)))  # fmt: skip
    cap = CAPACITY_GIB.get(ours8["env.gpu"])
    targets.append(Target(f"8B peak memory per GPU below {HEADROOM:.0%} of the card",
                          None if cap is None else f"{ours8['metrics.peak_gib']:.1f} of {cap:.1f} GiB "
                          f"({ours8['metrics.peak_gib'] / cap:.0%})",
                          None if cap is None else bool(ours8["metrics.peak_gib"] < HEADROOM * cap)))  # fmt: skip
else:
    targets.append(Target(f"8B MFU >= {TARGET_8B_MFU:.0%} per GPU (FSDP2, 4 GPUs)", None, None))
for gpus, need in TARGET_PER_GPU.items():
    got = {p: scaled(p, gpus) for p in ("ddp", "fsdp")}
    have = {p: r["per GPU vs one"] for p, r in got.items() if r is not None}
    targets.append(Target(
        f"1B tokens/s per GPU on {gpus} GPUs >= {need}x one GPU's (DDP and FSDP2)",
        ", ".join(f"{p.upper()} {x:.3f}x" for p, x in have.items()) or None,
        bool(min(have.values()) >= need) if len(have) == 2 else None,
    ))  # fmt: skip
others = (
    [v[2] for k, v in DDP2.items() if k != ddp_main_key and k[1] == ddp_main_key[1]]
    if ddp_main
    else []
)
targets.append(Target(
    f"1B DDP on 2 GPUs >= {TARGET_2GPU}x one GPU's tokens/s",
    None if ddp_main is None else f"{ddp_main[2]:.3f}x (90% interval {ddp_main[3]:.3f}-{ddp_main[4]:.3f}"
    + (f"; embedding averaged {'row-wise' if ddp_main_key[1] == 'rows' else 'whole'}"
       + (f", {len(others)} more logs: {span(pd.Series(others), '.3f')}x" if others else "") + ", appendix)"),
    None if ddp_main is None else bool(ddp_main[2] >= TARGET_2GPU),
))  # fmt: skip
targets.append(Target(
    "checkpoint resume: the resumed loss matches the uninterrupted run within run-to-run noise (1B, FSDP2, 4 GPUs)",
    None if RESUME is None else f"largest loss gap {RESUME['gap']:.4f} after step {RESUME['at']}, "
    f"run-to-run noise {RESUME['noise']:.4f}",
    None if RESUME is None else bool(RESUME["gap"] <= RESUME["noise"]),
))  # fmt: skip


def provenance():
    """One row per log (and per trace) the report reads: git commit, GPU model, GPU tags, runs."""
    frames = [f for f in (runs, multi, alone_log) if f is not None]
    logs = envs_by_log(pd.concat(frames)) if frames else {}
    for path in traces + sorted(LM.glob("traces/kernels_*.json*")):
        run = path.name.split(".")[0].removeprefix("trace_").removeprefix("kernels_")
        rec = summ[summ["run"].isin([run, run + "_profile"])]
        if len(rec):  # a trace: one run's, the one of its summary record
            logs[f"traces/{path.name}"] = frame_envs(rec.iloc[:1])
    # Several-GPU runs log rank 0's GPU tag only.
    return log_provenance(logs).rename(columns={"GPU tag(s)": "GPU tags (rank 0)"})


PROVENANCE = provenance()


def second_gpu_runs():
    """The one-GPU runs on GPUs other than the study's (the one with most runs): micro-batches per
    step and the attention backend, each beside the study GPU's run of the same setting, if any."""
    gpu = summ["env.gpu_id"].fillna("CPU")
    study_gpu = gpu.mode().iloc[0]
    other = summ[(gpu != study_gpu) & ~flag(summ, "profile")]
    key = ["config.sequence_length", "config.batch_size", "config.grad_accumulation",
           "config.precision", "config.fused_optimizer", "config.compile", "config.attention"]  # fmt: skip
    study = summ[(gpu == study_gpu) & ~flag(summ, "profile")]
    rows = []
    for _, r in other.iterrows():
        same = study[(study[key].astype(str) == r[key].astype(str)).all(axis=1)]
        rows.append({
            "GPU tag": r["env.gpu_id"], "seq": int(r["config.sequence_length"]),
            "batch x micro-batches": f"{int(r['config.batch_size'])} x {int(r['config.grad_accumulation'])}",
            "attention": r.get("config.attention") or "auto",
            "tokens/s": r["metrics.tokens_per_s"], "MFU": r["metrics.mfu"],
            "peak GiB": r["metrics.peak_gib"],
            "study GPU, same setting (tokens/s)": same["metrics.tokens_per_s"].median() if len(same) else None,
        })  # fmt: skip
    return pd.DataFrame(rows)


SECOND_GPU = second_gpu_runs()
