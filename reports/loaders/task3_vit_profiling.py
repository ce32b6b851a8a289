"""Loads the ViT pipeline and profiler logs (results/vit/) for task3_vit_profiling.ipynb.

Builds what the report's sections read: the pipeline runs of the report's host, labelled by the
settings each undoes against the fixed preset; the fixed pipeline's repeated runs (their median,
``FIXED``, and their range per metric, the noise band, ``NOISE``) and each change judged against
them (CLS); the profiler records of the pipelines (ops, module forward ranges, per-iteration ranges,
per-layer comparison, Profile's overhead); the per-iteration breakdown of the fixed pipeline's
torch.profiler trace (IT, and the ranges of one iteration); the rows of the answers table
(``answers``) and the stand-in line above it (``STAND_IN_LINE``); the provenance table of every
log and trace read (``PROVENANCE``); and, for the appendix, the headline speed-up beside the same ratio from the
replicate log (``vit_pipeline_replicate.jsonl``, the same commands on another host, kept out of
every other section): ``REPLICATE_TABLE`` and ``REPLICATE_LINES``. It displays nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import gzip
import json
import pathlib
import re

import numpy as np
import pandas as pd
from loaders.replicates import (  # reports/loaders/ (cwd: reports/)
    envs_by_log,
    frame_envs,
    log_provenance,
    provenance,
)

import effdl
from effdl.answers import Answer
from effdl.data.stand_in import stand_in_values
from effdl.results import load_results, results_dir
from effdl.tables import is_missing, measured

RESULTS = results_dir("results") / "vit"
NOT_MEASURED = "not measured"
TARGET_SPEEDUP, TARGET_WAIT, TARGET_OVERHEAD, TARGET_LAYER, LAYER_MIN_MS = (
    5.0,
    0.10,
    0.05,
    0.10,
    1.0,
)
H100_BF16_DENSE_TFLOPS = 989.0  # datasheet, dense (no sparsity)
H100_SMS = 132  # datasheet, H100 SXM
# The fixed preset's settings and the flag that undoes each (task3_vit_profiling/README.md).
FLAGS = {
    "pipeline": "--pipeline", "model": "--model", "data_path": "--data-path",
    "augmix_on": "--augmix-on", "workers": "--workers", "pin_memory": "--pin-memory",
    "non_blocking": "--non-blocking", "precision": "--precision", "cudnn": "--cudnn",
    "sync_every_step": "--sync-every-step", "val_no_grad": "--val-no-grad",
    "val_divisor": "--val-divisor", "set_to_none": "--set-to-none", "fused_adam": "--fused-adam",
    "compile": "--compile",
}  # fmt: skip
SETTINGS = [f for f in FLAGS if f != "pipeline"]
VAL_ONLY = {"val_no_grad", "val_divisor"}  # settings the training pass does not use
# The changes, numbered and named as in task3_vit_profiling/README.md: 1-6 the assignment's six
# inefficiencies, 7-8 beyond them; each with where it sits as given and the run that undoes it.
CHANGES = {
    1: ("data processing", "Dataset: CSV re-read, pandas `.loc` per item, full-size JPEG decode",
        "label array, `Image.draft` decode, one crop + resize, uint8"),
    2: ("data loading", "`num_workers=0`, pageable memory, blocking copies",
        "16 workers, pinned memory, `non_blocking`"),
    3: ("model", "widths 255; heads never split; attention LayerNorm unused; `nn.Softmax`",
        "256 wide, 4 x 64 heads, pre-norm, `scaled_dot_product_attention`"),
    4: ("numerics", "fp32, `cudnn.deterministic`", "bf16 autocast, `cudnn.benchmark`"),
    5: ("per-step sync", "`.item()` on loss and accuracy every step", "statistics kept on the device"),
    6: ("validation", "no `no_grad`; averages over the training loader's length",
        "`inference_mode`, image-weighted averages"),
    7: ("optimizer step", "in-place `zero_grad`, for-each Adam", "`set_to_none`, fused Adam"),
    8: ("AugMix on the device", "AugMix per image in the loader", "BatchedAugMix on the GPU batch"),
}  # fmt: skip
# Where each change sits in the as-given pipeline: the assignment's area (data processing, model,
# training loop) and the code that holds the as-given behaviour.
WHERE = {
    1: ("data processing", "`AsGivenClothingDataset` (effdl/data/clothing.py)"),
    2: ("data processing", "`make_loaders` (effdl/vit_pipeline/data.py)"),
    3: ("model", "`Attention` of preset `AS_GIVEN` (effdl/models/vit.py)"),
    4: ("training loop", "`build_trainer` (effdl/vit_pipeline/training.py)"),
    5: ("training loop", "`BatchStats.add` (effdl/vit_pipeline/training.py)"),
    6: ("training loop", "`run_phase` (effdl/vit_pipeline/training.py)"),
    7: ("training loop", "`build_trainer`, `Trainer.train_step` (effdl/vit_pipeline/training.py)"),
    8: ("data processing", "`as_given_transforms` (effdl/data/clothing.py)"),
}  # fmt: skip
UNDO = {  # the run that undoes each change (a setting of the fixed preset) and what it changes
    "model": 3, "precision": 4, "cudnn": 4, "sync_every_step": 5, "val_no_grad": 6,
    "set_to_none": 7, "fused_adam": 7, "augmix_on": 8,
}  # fmt: skip
README = pathlib.Path(effdl.__file__).resolve().parents[1] / "task3_vit_profiling" / "README.md"
readme_names = dict(
    (int(n), name.strip())
    for n, name in re.findall(r"^\| (\d+) \| ([^|]+) \|", README.read_text(), re.M)
)
assert readme_names == {n: c[0] for n, c in CHANGES.items()}, (README, readme_names)
m = "metrics."


def load(pattern, exclude=None):
    # Every record of the logs matching pattern (anywhere under RESULTS), but for the logs whose
    # file name matches the regular expression exclude; None where no record is left.
    try:
        df = load_results(RESULTS, pattern=pattern)
    except FileNotFoundError:
        return None
    excluded = df["source"].map(
        lambda s: bool(exclude and re.search(exclude, pathlib.Path(s).name))
    )
    if excluded.any():
        # The kept logs read again on their own: no column or type comes from an excluded one.
        kept = list(dict.fromkeys(df.loc[~excluded, "source"]))
        if not kept:
            return None
        frames = [load_results(RESULTS, pattern=s) for s in kept]
        df = pd.concat(
            [f[f["source"] == s] for f, s in zip(frames, kept, strict=True)], ignore_index=True
        )
    for c in [
        c for c in df.columns if c.startswith(m) and not pd.api.types.is_numeric_dtype(df[c])
    ]:
        num = pd.to_numeric(df[c], errors="coerce")  # "nan" strings where a metric has no value
        if num.notna().sum() == (df[c].notna() & (df[c].astype(str) != "nan")).sum():
            df[c] = num
    gpu_id = df["env.gpu_id"] if "env.gpu_id" in df else pd.Series(np.nan, index=df.index)
    gpu = df["env.gpu"] if "env.gpu" in df else pd.Series(np.nan, index=df.index)
    cpu = df["env.cpu"] if "env.cpu" in df else pd.Series("", index=df.index)
    # A host is its GPU tag; logs without one come from a single host per GPU model.
    df["host"] = np.where(
        gpu_id.notna(), gpu.fillna("CPU").astype(str) + " #" + gpu_id.astype(str),
        gpu.fillna("CPU (" + cpu.astype(str) + ")").astype(str),
    )  # fmt: skip
    return df


def data_set(source):
    kind = "generated Clothing-like" if str(source).startswith("clothing_like") else "real Clothing"
    return f"{kind} data set `{source}`"


def gpu_name(host):
    # The GPU model of a host label ("NVIDIA H200 #24c7bc89" -> "NVIDIA H200"): captions and
    # titles name the GPU; its tag is in the provenance appendix only.
    return str(host).split(" #")[0] if host else NOT_MEASURED


def flag(field, value):
    if isinstance(value, bool):
        return f"{FLAGS[field]}" if value else f"--no-{FLAGS[field][2:]}"
    return f"{FLAGS[field]} {value}"


def busiest(df, kinds):
    # The host with the most records of these kinds (ties: the first in name order), or None.
    sub = df[df["config.kind"].isin(kinds)] if df is not None else []
    return None if not len(sub) else sub.groupby("host").size().sort_index().idxmax()


# The replicate log holds the same commands run on another host; it is read only by the appendix
# (``REPLICATE``), never mixed into the main sections.
REPLICATE_LOG = "vit_pipeline_replicate.jsonl"
REPLICATE_NAMES = r"replicate"
runs = load("vit_pipeline*.jsonl", exclude=REPLICATE_NAMES)
prof_all = load("vit_profile*.jsonl")
main = main_all = PIPE_HOST = None
DATA = MAIN_SOURCE = NOT_MEASURED
ON_GPU = False
if runs is not None:
    # The main comparison: the data set with the most images.
    MAIN_SOURCE = runs.loc[runs["config.n_images"].idxmax(), "config.source"]
    main_all = runs[runs["config.source"] == MAIN_SOURCE].copy()
    DATA = data_set(MAIN_SOURCE)
    ON_GPU = main_all["config.device"].astype(str).str.startswith("cuda").any()
    fixed_ref = main_all[main_all["config.pipeline"] == "fixed"]
    base = {f: fixed_ref[f"config.{f}"].mode().iloc[0] for f in SETTINGS} if len(fixed_ref) else {}

    def label(r):
        # "fixed", "as given", or "fixed, <settings undone>".
        if r["config.pipeline"] == "as_given":
            return "as given"
        diff = [f"{f}={r[f'config.{f}']}" for f in SETTINGS if r[f"config.{f}"] != base[f]]
        return "fixed" if not diff else "fixed, " + " + ".join(diff)

    main_all["run"] = main_all.apply(label, axis=1)
    main_all["undone"] = [
        set() if r == "fixed" or r == "as given" else
        {p.split("=")[0] for p in r.removeprefix("fixed, ").split(" + ")}
        for r in main_all["run"]
    ]  # fmt: skip
    # After the first batch (the workers' start-up): waits exactly, steps from the logged ratio.
    for p in ("train", "val"):
        main_all[f"{p}_wait_after"] = main_all[f"{m}{p}_wait_s"] - main_all[f"{m}{p}_first_wait_s"]
        main_all[f"{p}_step_after"] = (
            main_all[f"{p}_wait_after"] / main_all[f"{m}{p}_wait_over_step"]
        )
        main_all[f"{p}_first_step"] = main_all[f"{m}{p}_step_s"] - main_all[f"{p}_step_after"]
    main_all["epoch_wait_over_step"] = (
        main_all["train_wait_after"] + main_all["val_wait_after"]
    ) / (main_all["train_step_after"] + main_all["val_step_after"])
    for p in ("train", "val"):
        main_all[f"{p}_step_median_ms"] = main_all[f"{m}{p}_step_s_median"] * 1e3
    # One host for the report: the one with the most pipeline runs.
    PIPE_HOST = main_all.groupby("host")["run"].nunique().sort_index().idxmax()
    main = main_all[main_all["host"] == PIPE_HOST].copy()
# Profiler logs: one host for the pipelines' profiles (ops, module ranges, iteration ranges, the
# trace) and one for the per-layer comparison and Profile's overhead: the host with most records.
PROF_HOST = busiest(prof_all, ["module", "op", "range"])
LAYER_HOST = busiest(prof_all, ["layer_compare", "overhead"])
prof = None
if prof_all is not None:
    # Per pipeline and host, the newest profile run (config.run_id).
    newest = prof_all.groupby(["config.pipeline", "host"])["config.run_id"].transform("max")
    prof_all = prof_all[prof_all["config.run_id"] == newest].copy()
    layer_kinds = prof_all["config.kind"].isin(["layer_compare", "overhead", "layer_agreement"])
    prof = prof_all[
        (layer_kinds & (prof_all["host"] == LAYER_HOST))
        | (~layer_kinds & (prof_all["host"] == PROF_HOST))
    ].copy()


def of_kind(kind, pipeline="fixed", frame=None):
    # The profile records of one kind for one pipeline (empty when not in the logs).
    frame = prof if frame is None else frame
    if frame is None:  # no profile logs: no rows, the columns the cells group by
        return pd.DataFrame(columns=["host", "config.kind", "config.pipeline", "config.run_id"])
    return frame[(frame["config.kind"] == kind) & (frame["config.pipeline"] == pipeline)].copy()


def met(ok, value=0.0):
    return NOT_MEASURED if is_missing(value) else ("**met**" if ok else "**not met**")


def at(frame, col, *keys, default=np.nan):
    # frame.loc[keys, col], or default where the row or column is missing.
    try:
        return frame.loc[keys if len(keys) > 1 else keys[0], col]
    except (KeyError, TypeError, AttributeError):
        return default


# Each change against the run-to-run noise of the fixed pipeline, on the report's host. The
# reference is the median of the fixed pipeline's runs (every setting as preset); the noise band
# of a metric is their range (max - min), measured where the logs hold at least MIN_FIXED_RUNS of
# them. A change is faster beyond noise where the run that undoes it is slower than that median by
# more than the band.
MIN_FIXED_RUNS = 2
METRICS = {  # the metric each pass is judged by, and its label
    "train": ("train_step_median_ms", "median training step (ms)"),
    "val": ("val_step_median_ms", "median validation step (ms)"),
    "loader": ("train_wait_after", "training wait on the loader after the first batch (s)"),
    "epoch": (m + "epoch_s", "epoch, training + validation (s)"),
}
FASTER = "faster beyond noise"
VERDICTS = {  # d = undone - fixed: > band, within the band, < -band
    1: FASTER, 0: "within noise (tried)", -1: "slower with the change, beyond noise (tried)",
}  # fmt: skip
FIXED_RUNS = main[main["run"] == "fixed"] if main is not None else pd.DataFrame()
N_FIXED = len(FIXED_RUNS)
BAND_MEASURED = N_FIXED >= MIN_FIXED_RUNS
FIXED_WHAT = "fixed" if N_FIXED < 2 else f"fixed (median of {N_FIXED} runs)"
_undone = main[main["undone"].map(bool)] if main is not None else pd.DataFrame()
UNDONE_RUNS = (  # how the undone settings' runs are read: one each, or the newest of several
    "one run per undone setting"
    if not len(_undone) or _undone["run"].value_counts().max() == 1
    else "the newest run of each undone setting"
)


def fixed_median():
    # The fixed pipeline as one row: its last run's settings, each numeric column the median over
    # its runs (the single run where there is one). None without a fixed run.
    if not N_FIXED:
        return None
    r = FIXED_RUNS.iloc[-1].copy()
    num = FIXED_RUNS.select_dtypes("number").columns
    r[num] = FIXED_RUNS[num].median()
    return r


FIXED = fixed_median()


def pick(name, frame=None):
    # The run called name on the report's host (or in frame), or None; "fixed" on the report's
    # host: the median of its runs (fixed_median).
    if name == "fixed" and frame is None:
        return FIXED
    frame = main if frame is None else frame
    if frame is None:
        return None
    r = frame[frame["run"] == name]
    return r.iloc[-1] if len(r) else None


NOISE = pd.DataFrame(
    [
        {
            "metric": what, "runs": N_FIXED, "median": FIXED_RUNS[col].median(),
            "min": FIXED_RUNS[col].min(), "max": FIXED_RUNS[col].max(),
            "noise band (max - min)": (FIXED_RUNS[col].max() - FIXED_RUNS[col].min())
            if BAND_MEASURED else np.nan,
        }
        for col, what in METRICS.values()
    ]
    if N_FIXED
    else [],
    index=list(METRICS) if N_FIXED else None,
)  # fmt: skip


def band(key):
    return NOISE.loc[key, "noise band (max - min)"] if len(NOISE) else np.nan


def verdict(d, b):
    return NOT_MEASURED if is_missing(b) else VERDICTS[int(np.sign(d)) if abs(d) > b else 0]


rows = []
if N_FIXED:
    # The metric each undone change is judged by: AugMix moves work between the loader and the
    # step, so the loader's wait; a validation setting, the validation step; else the training step.
    main["judged by"] = [
        None if not u else "loader" if "augmix_on" in u else "val" if u <= VAL_ONLY else "train"
        for u in main["undone"]
    ]
    epoch = m + "epoch_s"
    for _, r in main[main["judged by"].notna()].iterrows():
        u, key = r["undone"], r["judged by"]
        col, what = METRICS[key]
        d = r[col] - FIXED[col]  # > 0: undoing the change is slower, the change saves time
        rows.append({
            "#": min(UNDO.get(f, 0) for f in u), "run (change undone)": r["run"], "metric": what,
            "fixed": FIXED[col], "undone": r[col], "undone - fixed": d, "noise band": band(key),
            "verdict": verdict(d, band(key)), "epoch: undone - fixed (s)": r[epoch] - FIXED[epoch],
        })  # fmt: skip
    # 1 and 2 together: the as-given loader against the fixed data path and loader (AugMix still
    # per image in the workers); no run undoes either alone. The reference is that one run.
    a, lo = pick("as given"), pick("fixed, augmix_on=loader")
    if a is not None and lo is not None:
        d = a["train_wait_after"] - lo["train_wait_after"]
        rows.append({
            "#": 1, "run (change undone)": "as given vs fixed, augmix_on=loader (1 + 2 together)",
            "metric": METRICS["loader"][1], "fixed": lo["train_wait_after"],
            "undone": a["train_wait_after"], "undone - fixed": d, "noise band": band("loader"),
            "verdict": verdict(d, band("loader")), "epoch: undone - fixed (s)": a[epoch] - lo[epoch],
        })  # fmt: skip
CLS = pd.DataFrame(rows).sort_values("#", kind="stable") if rows else pd.DataFrame()


def verdicts(n):
    # The classification rows of change n (1 and 2 share theirs).
    if not len(CLS):
        return pd.DataFrame(columns=["#", "run (change undone)", "verdict"])
    return CLS[CLS["#"] == (1 if n in (1, 2) else n)]


def short(run):
    # A run's name without the preset: "sync_every_step=True", "as given vs augmix_on=loader (...)".
    return run.removeprefix("fixed, ").replace("as given vs fixed, ", "as given vs ")


def bought(n):
    # What change n bought, from its rows: "metric undone -> fixed (band: verdict)".
    v = verdicts(n)
    if not len(v):
        return f"{NOT_MEASURED} (no run undoes it)"
    return "; ".join(
        f"{short(r['run (change undone)'])}: {r['metric']} {r['undone']:.3g} undone -> "
        f"{r['fixed']:.3g} ("
        + (
            f"noise band {r['noise band']:.2g}: {r['verdict']}"
            if BAND_MEASURED
            else "noise band not measured"
        )
        + ")"
        for _, r in v.iterrows()
    )


QUALIFY = [n for n in CHANGES if (verdicts(n)["verdict"] == FASTER).any()]
# Every change as measured: #1 and #2 share one measurement (no run undoes either alone), counted
# once; 1-6 the assignment's six, 7 and 8 beyond them.
UNITS = [(1, 2), (3,), (4,), (5,), (6,), (7,), (8,)]
UNITS_OK = [u for u in UNITS if u[0] in QUALIFY]
TARGET_FIXES = 5  # inefficiencies found and fixed, #1 and #2 counted once


def qualified(n):
    # "#4 (cudnn=deterministic only)" where only some of a change's runs gain beyond noise.
    v = verdicts(n)
    ok = v[v["verdict"] == FASTER]["run (change undone)"]
    part = len(ok) < len(v)
    return f"#{n}" + (f" ({', '.join(short(r) for r in ok)} only)" if part else "")


def unit_label(u):
    # "#1 + #2 (measured together)" for the shared measurement, else qualified(n).
    return (
        " + ".join(f"#{n}" for n in u) + " (measured together)" if len(u) > 1 else qualified(u[0])
    )


TRIED = CLS[CLS["verdict"] != FASTER] if len(CLS) else CLS  # within the band, or slower


def module_parts(g):
    # Kernel and host time per iteration of the assignment's parts of the forward.
    g = g[g[m + "cpu_time_total_us"] > 0].copy()
    g["path"] = g[m + "name"].str.slice(len("module: ")).str.rsplit(": ", n=1).str[0]
    g["cls"] = g[m + "name"].str.rsplit(": ", n=1).str[1]

    def part(path, cls):
        if path == "model":
            return "whole ViT"
        if path.startswith("to_patch_embedding"):
            return "patch embedding" if path == "to_patch_embedding" else f"  {cls} (embedding)"
        if cls in ("Attention", "FeedForward", "Softmax", "GELU", "LayerNorm"):
            return {
                "Attention": "attention (self-attention part)",
                "FeedForward": "feed-forward",
            }.get(cls, cls)
        return "head" if path == "mlp_head" else None

    g["part"] = [part(p, c) for p, c in zip(g["path"], g["cls"], strict=True)]
    active = int(g["config.active"].iloc[0])
    t = g.dropna(subset=["part"]).groupby("part").agg(
        modules=("path", "nunique"), calls=(m + "calls", "sum"),
        host_ms=(m + "cpu_time_total_us", "sum"), kernel_ms=(m + "device_time_total_us", "sum"),
    )  # fmt: skip
    t["calls / iter"] = t.pop("calls") / active
    t["host ms / iter"] = t.pop("host_ms") / active / 1e3
    t["GPU kernels ms / iter"] = t.pop("kernel_ms") / active / 1e3
    t["share of ViT forward kernels"] = t["GPU kernels ms / iter"] / at(
        t, "GPU kernels ms / iter", "whole ViT"
    )
    return t


PARTS = {
    p: module_parts(of_kind("module", p))
    for p in ("as_given", "fixed")
    if len(of_kind("module", p))
}


RANGE_NAMES = ("data_wait", "to_device", "train_step", "batch_stats")
RANGE_COLUMNS = ["range", "host ms", "GPU activities", "GPU busy ms", "span on the GPU timeline ms",
                 "share of the iteration (host)"]  # fmt: skip


def trace_iterations():
    # Per ProfilerStep of the fixed pipeline's torch.profiler trace: the GPU activities launched
    # inside it (by correlation id), split by where they were launched. None without a trace.
    paths = sorted(
        RESULTS.glob("**/*_torch_trace.json*"), key=lambda p: not p.name.startswith("fixed")
    )
    if not paths:
        return None
    path = paths[0]
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted(
        (e for e in ev if str(e.get("name", "")).startswith("ProfilerStep")), key=lambda e: e["ts"]
    )
    launch = {e["args"]["correlation"]: e for e in ev
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}  # fmt: skip
    gpu_all = [e for e in ev if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
               and e.get("args", {}).get("correlation") in launch]  # fmt: skip

    def inside(t, r):
        return r["ts"] <= t <= r["ts"] + r["dur"]

    def ms(acts):
        return sum(a["dur"] for a in acts) / 1e3

    out = []
    for s in steps:
        acts = [a for a in gpu_all if inside(launch[a["args"]["correlation"]]["ts"], s)]
        fwd_ranges = [e for e in ev if e.get("name") == "module: model: ViT" and e.get("cat") != "gpu_user_annotation"
                      and inside(e["ts"], s)]  # fmt: skip
        fwd = [a for a in acts if any(inside(launch[a["args"]["correlation"]]["ts"], r)
                                      and launch[a["args"]["correlation"]]["tid"] == r["tid"] for r in fwd_ranges)]  # fmt: skip
        # Autograd runs the backward on its own thread: the launches from other threads.
        bwd = [a for a in acts if launch[a["args"]["correlation"]]["tid"] != s["tid"]]
        # The optimizer's own kernels, by name (fused/for-each Adam: multi_tensor_apply kernels).
        opt = [
            a
            for a in acts
            if a.get("cat") == "kernel" and re.search("adam|multi_tensor", a["name"], re.I)
        ]
        end = max((a["ts"] + a["dur"] for a in acts), default=s["ts"])
        # The iteration's named ranges: the GPU activities launched inside each (from any thread:
        # the backward's launches fall in train_step) and their span on the GPU timeline.
        ranges = []
        for e in ev:
            if e.get("name") not in RANGE_NAMES or e.get("cat") == "gpu_user_annotation":
                continue
            if not inside(e["ts"], s):
                continue
            r_acts = [a for a in acts if inside(launch[a["args"]["correlation"]]["ts"], e)]
            ranges.append({
                "range": e["name"], "host ms": e["dur"] / 1e3, "GPU activities": len(r_acts),
                "GPU busy ms": ms(r_acts),
                "span on the GPU timeline ms": (max(a["ts"] + a["dur"] for a in r_acts)
                                                - min(a["ts"] for a in r_acts)) / 1e3 if r_acts else 0.0,
                "share of the iteration (host)": e["dur"] / s["dur"],
            })  # fmt: skip
        out.append({
            "iteration": s["name"], "iteration ms (host)": s["dur"] / 1e3, "GPU activities": len(acts),
            "GPU busy ms": ms(acts), "forward ms": ms(fwd), "forward kernels": len(fwd),
            "backward ms": ms(bwd), "backward kernels": len(bwd), "optimizer ms": ms(opt),
            "optimizer kernels": len(opt), "last GPU end after host end (ms)": (end - s["ts"] - s["dur"]) / 1e3,
            "_step": s, "_acts": acts, "_phases": {"forward": fwd, "backward": bwd, "optimizer": opt},
            "_ranges": pd.DataFrame(ranges, columns=RANGE_COLUMNS).set_index("range"),
        })  # fmt: skip
    return path, ev, pd.DataFrame(out).set_index("iteration") if out else None


TRACE = trace_iterations()
IT = (
    TRACE[2]
    if TRACE is not None and TRACE[2] is not None and TRACE[2]["GPU activities"].sum()
    else None
)
RNG = of_kind("range").set_index(m + "range") if len(of_kind("range")) else None

# The answers, each from the logs above.
fixed, given = pick("fixed"), pick("as given")
pf, pa = PARTS.get("fixed"), PARTS.get("as_given")


def kern(t, part):
    # A part's GPU kernel time per iteration; "not measured" where the trace has none (a CPU run).
    ms = at(t, "GPU kernels ms / iter", part) if t is not None else np.nan
    return measured(ms if ms > 0 else np.nan, ".2f", " ms")


mid = IT.iloc[len(IT) // 2] if IT is not None else None
# The named ranges of that one iteration (host time, GPU work launched inside, GPU span).
RANGES_MID = mid["_ranges"] if mid is not None else None


def mid_at(col, *keys):
    # A value of the middle iteration (its row of IT, or of its ranges), NaN without a trace.
    if mid is None:
        return np.nan
    return mid[col] if not keys else at(RANGES_MID, col, *keys)


ratio = mid["backward ms"] / mid["forward ms"] if mid is not None and mid["forward ms"] else np.nan
speedup = (
    fixed[m + "images_per_s"] / given[m + "images_per_s"]
    if fixed is not None and given is not None
    else np.nan
)


def acc(r):
    return measured(r[m + "val_accuracy"] * 100 if r is not None else np.nan, ".1f", "%")


wait_share = mid_at("host ms", "data_wait") / mid_at("iteration ms (host)")
_mod = of_kind("module")
MOD_BATCH = (
    f", batch {int(_mod['config.batch_size'].iloc[0])}"
    if len(_mod) and "config.batch_size" in _mod
    else ""
)
HOSTS = [PIPE_HOST] if main is not None else []
PIPE_GPU, PROF_GPU, LAYER_GPU = gpu_name(PIPE_HOST), gpu_name(PROF_HOST), gpu_name(LAYER_HOST)


def op_pairs():
    # Self GPU time per iteration of ops with a forward and a backward kernel of their own (fixed
    # profile's op records): [(forward op, backward op, forward ms, backward ms)].
    ops = of_kind("op")
    if not len(ops):
        return []
    per_op = ops.groupby(m + "name")[m + "self_device_time_total_us"].sum()
    per_op = per_op / int(ops["config.active"].iloc[0]) / 1e3
    pairs = (
        ("aten::native_layer_norm", "aten::native_layer_norm_backward"),
        ("aten::_cudnn_attention_forward", "aten::_cudnn_attention_backward"),
        ("aten::gelu", "aten::gelu_backward"),
    )
    return [(f, b, per_op[f], per_op[b]) for f, b in pairs
            if f in per_op and b in per_op and per_op[f] > 0]  # fmt: skip


OP_NAMES = {"aten::native_layer_norm": "LayerNorm", "aten::_cudnn_attention_forward": "attention",
            "aten::gelu": "GELU"}  # fmt: skip


BWD_PAIRS = op_pairs()


def stand_in_line():
    # One line: the generated stand-in against the real Clothing set's published figures
    # (stand_in_data.jsonl: image and label counts from Kaggle; photo sizes are not published).
    si = load("stand_in_data.jsonl")
    si = None if si is None else si[si["config.source"] == MAIN_SOURCE]
    if si is None or si.empty:
        return f"Data: {DATA}; its statistics against the real set: {NOT_MEASURED}."
    v = stand_in_values(si)
    got, pub = v["measured"], v["published"]
    counts = v.index.str.startswith("count_")
    off = (got[counts] - pub[counts]).abs().max()
    return (
        f"Data: a generated Clothing-like stand-in (`{MAIN_SOURCE}`), not the real photos: "
        f"{got['images']:,.0f} images in {got['labels']:.0f} labels against the real set's "
        f"{pub['images']:,.0f} in {pub['labels']:.0f} (Kaggle), each label's count within "
        f"{off:.0f} image of the real one; photos {got['long_side_p0']:,.0f}-"
        f"{got['long_side_p100']:,.0f} px on the long side (median {got['long_side_p50']:,.0f}), "
        "sizes the real set does not publish."
    )


STAND_IN_LINE = stand_in_line()
# The changes whose undoing made their own metric shorter in these runs (faster undone).
FASTER_UNDONE = CLS[CLS["undone - fixed"] < 0] if len(CLS) else CLS


def step_vs(r):
    # "validation step 7.3 vs 9.8 ms" / "step 52.6 vs 63.4 ms": a CLS row's step times.
    val = "validation " if r["metric"].startswith("median validation") else ""
    return f"{val}step {r['undone']:.1f} vs {r['fixed']:.1f} ms"


def undone_faster_text():
    # The changes faster when undone, each with its numbers, and the fixed runs' own range.
    if not len(FASTER_UNDONE):
        return "(undone vs fixed median): none"
    lo, hi = NOISE.loc["train", "min"], NOISE.loc["train", "max"]
    return (
        "(undone vs fixed median) "
        + ", ".join(f"{change_label(r)} {step_vs(r)}" for _, r in FASTER_UNDONE.iterrows())
        + f"; the {N_FIXED} fixed runs' own training steps: {lo:.1f}-{hi:.1f} ms"
    )


def change_label(r):
    # "#1 + #2" for the shared measurement, else "#5 (sync_every_step=True)": a row of CLS.
    return "#1 + #2" if r["#"] == 1 else f"#{r['#']} ({short(r['run (change undone)'])})"


def fixes_answer():
    # The changes that speed training up beyond the fixed runs' band, and those only tried.
    if not len(CLS):
        return NOT_MEASURED
    if not BAND_MEASURED:
        return (
            f"{NOT_MEASURED}: the noise band needs at least {MIN_FIXED_RUNS} runs of the fixed "
            f"pipeline and these logs hold {N_FIXED}; no change is counted"
        )
    undone = ", ".join(dict.fromkeys(f"#{n}" for n in FASTER_UNDONE["#"])) or "none"
    return (
        f"**{len(UNITS_OK)}** beyond noise: {', '.join(unit_label(u) for u in UNITS_OK) or 'none'}; "
        f"faster when undone, within noise: {undone}"
    )


def change_answer(n):
    # One inefficiency's row: the code that holds it as given, the fix, and its verdict.
    v = verdicts(n)
    if not len(v):
        got = f"{NOT_MEASURED} (no run undoes it)"
    else:
        got = "; ".join(
            (f"{short(r['run (change undone)'])}: " if len(v) > 1 else "")
            + (
                f"wait {r['undone']:.0f} s -> {r['fixed']:.1f} s"
                if r["metric"].startswith("training wait")
                else f"{step_vs(r)} undone vs fixed"
            )
            + f", {r['verdict'].removesuffix(' (tried)')}"
            for _, r in v.iterrows()
        )
    return f"{WHERE[n][1].split(' (')[0]}; fix: {CHANGES[n][2]}. {got}"


NO_KERNELS = f"{NOT_MEASURED}: the profile holds no GPU kernels ({PROF_GPU})"
answers = [
    Answer("Forward: embedding, attention (self-attention, feed-forward), nn.Softmax, nn.GELU",
           NO_KERNELS if kern(pf, "whole ViT") == NOT_MEASURED else
           f"GPU kernels per iteration, fixed model ({PROF_GPU}{MOD_BATCH}): patch embedding "
           f"{kern(pf, 'patch embedding')}, self-attention {kern(pf, 'attention (self-attention part)')}, "
           f"feed-forward {kern(pf, 'feed-forward')}, GELU {kern(pf, 'GELU')} of a "
           f"{kern(pf, 'whole ViT')} forward; Softmax {kern(pa, 'Softmax')} in the as-given model "
           f"(forward {kern(pa, 'whole ViT')})", "Forward pass per part"),
    Answer("Backward vs forward", NO_KERNELS if not ratio > 0 else
           f"{measured(mid['backward ms'] if mid is not None else np.nan, '.2f', ' ms')} vs "
           f"{measured(mid['forward ms'] if mid is not None else np.nan, '.2f', ' ms')} of kernels in one "
           f"iteration: **{measured(ratio, '.2f', 'x')}**; the GEMMs' FLOPs give 2x"
           + ("" if not BWD_PAIRS else ", the backward of "
              + ", ".join(f"{OP_NAMES[f]} {tb / tf:.1f}x" for f, _, tf, tb in BWD_PAIRS[:2])
              + " its forward"), "Trace: one training iteration"),
    Answer("Several training iterations",
           (f"{len(IT)} iterations recorded, each {IT['iteration ms (host)'].min():.0f}-"
            f"{IT['iteration ms (host)'].max():.0f} ms on the host, GPU busy {IT['GPU busy ms'].min():.1f}-"
            f"{IT['GPU busy ms'].max():.1f} ms of it; in {mid.name}, {mid_at('GPU busy ms', 'to_device'):.1f} ms "
            f"of that is `to_device` (copy + BatchedAugMix), data wait {wait_share:.1%}")
           if mid is not None else NOT_MEASURED, "Trace: one training iteration"),
    *[Answer(f"Inefficiency {n}: {CHANGES[n][0]}", change_answer(n),
             "Each change against the run-to-run noise") for n in range(1, 7)],
    Answer("Inefficiencies fixed, faster beyond noise", fixes_answer(),
           "Each change against the run-to-run noise"),
    Answer("Overall speed-up (train + validation epoch)",
           f"**{measured(speedup, '.1f', 'x')}** images/s, {FIXED_WHAT} vs as given, {PIPE_GPU}; "
           f"validation accuracy {acc(fixed)} vs {acc(given)}", "Before and after"),
]  # fmt: skip


def provenance_table():
    """One row per log and trace the report reads: git commit, GPU model, GPU tags, runs."""
    frames = [f for f in (runs, prof, load(REPLICATE_LOG)) if f is not None]
    logs = envs_by_log(pd.concat(frames, ignore_index=True), sort=False) if frames else {}
    logs = {pathlib.Path(src).name: found for src, found in logs.items()}
    if TRACE is not None:  # the trace is written by the fixed pipeline's profile run
        logs[f"traces/{TRACE[0].name}"] = frame_envs(of_kind("range").iloc[:1])
    return log_provenance(logs)


# Appendix: the headline speed-up (images/s over the epoch, the median of the fixed pipeline's
# runs over the as-given run) computed the same way from the replicate log, one as-given and one
# fixed run of the same commands on another host. Compared only where the runs' config matches
# the main runs' on every field but these: the run's id, the real data set's folder (``source``
# names the set) and the processes that wrote the generated set once; the device by its kind.
CONFIG_IGNORED = {"run_id", "data", "generate_workers"}
HEADLINE = "images/s over the epoch, fixed / as given"


def headline(fixed_runs, as_given):
    # The report's speed-up: the fixed runs' median images/s over the as-given run's.
    if not len(fixed_runs) or as_given is None:
        return np.nan
    return fixed_runs[m + "images_per_s"].median() / as_given[m + "images_per_s"]


def config_diff(r, ref):
    # The config fields (but CONFIG_IGNORED) where run r differs from run ref: [(field, r, ref)].
    def value(row, k):
        v = row.get(f"config.{k}", np.nan)
        return str(v).split(":")[0] if k == "device" and not is_missing(v) else v

    def same(a, b):
        if is_missing(a) or is_missing(b):
            return is_missing(a) and is_missing(b)
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return str(a) == str(b)

    keys = {c[len("config.") :] for c in (*r.index, *ref.index) if c.startswith("config.")}
    return [
        (k, value(r, k), value(ref, k))
        for k in sorted(keys - CONFIG_IGNORED)
        if not same(value(r, k), value(ref, k))
    ]


def side(frame):
    # GPU name, host id and git sha (first 7 characters) of runs, each value once.
    return {k: ", ".join(v) or NOT_MEASURED for k, v in provenance(frame).items()}


def replicate_comparison():
    # (table or None, lines): the headline speed-up of the main log beside the replicate's.
    rep = load(REPLICATE_LOG)
    if rep is None:
        return None, [f"Second host: {NOT_MEASURED} (no {REPLICATE_LOG} in these logs)."]
    a_main = pick("as given")
    if not N_FIXED or a_main is None:
        return None, [
            f"Second host: {NOT_MEASURED} (the main log holds no fixed and as-given pair)."
        ]
    refs = {"fixed": FIXED_RUNS.iloc[-1], "as_given": a_main}
    used, lines = {}, []
    for pipe, ref in refs.items():
        recs = rep[rep["config.pipeline"] == pipe]
        if not len(recs):
            lines.append(f"The replicate log holds no {pipe} run.")
            continue
        diffs = [config_diff(r, ref) for _, r in recs.iterrows()]
        ok = [not d for d in diffs]
        if not any(ok):
            lines.append(
                f"The replicate's {pipe} run{'s' if len(recs) > 1 else ''} differ{'' if len(recs) > 1 else 's'} "
                f"from the main {pipe} run in its config: "
                + "; ".join(f"{k} {v} (main: {w})" for k, v, w in diffs[-1])
                + "."
            )
            continue
        if not all(ok):
            lines.append(
                f"{len(ok) - sum(ok)} of the replicate's {pipe} runs differ from the main config and are left out."
            )
        used[pipe] = recs[ok]
    if len(used) < 2:
        return None, [f"Second host: {NOT_MEASURED}, not compared.", *lines]
    main_x = headline(FIXED_RUNS, a_main)
    assert np.isclose(main_x, speedup), (main_x, speedup)  # the report's headline, the same way
    per_run = FIXED_RUNS[m + "images_per_s"] / a_main[m + "images_per_s"]
    a_rep = used["as_given"].iloc[-1]  # the newest, as pick() takes the main one
    rep_x = headline(used["fixed"], a_rep)
    main_side = side(pd.concat([FIXED_RUNS, a_main.to_frame().T]))
    rep_side = side(pd.concat([used["fixed"], a_rep.to_frame().T]))
    n_rep = len(used["fixed"])
    rep_per_run = used["fixed"][m + "images_per_s"] / a_rep[m + "images_per_s"]

    def spread(x):
        # The speed-up's range over the fixed runs of one log (not measured with one run).
        return f"{x.min():.2f}x to {x.max():.2f}x" if len(x) > 1 else f"{NOT_MEASURED} (one run)"

    table = pd.DataFrame({
        f"speed-up ({HEADLINE})": [f"{main_x:.2f}x", f"{rep_x:.2f}x"],
        "fixed runs": [N_FIXED, n_rep],
        "range over the fixed runs": [spread(per_run), spread(rep_per_run)],
        "relative to main": ["-", f"{rep_x / main_x - 1:+.1%}"],
        **{k: [main_side[k], rep_side[k]] for k in main_side},
        "log": [", ".join(dict.fromkeys(FIXED_RUNS["source"])), REPLICATE_LOG],
    }, index=["main", "replicate"])  # fmt: skip
    lines.insert(0, (
        f"Main log ({DATA}): fixed {FIXED[m + 'images_per_s']:.1f} images/s "
        f"({'one run' if N_FIXED == 1 else f'median of {N_FIXED} runs'}) against as given "
        f"{a_main[m + 'images_per_s']:.1f} images/s: {main_x:.2f}x. Replicate log: fixed "
        f"{used['fixed'][m + 'images_per_s'].median():.1f} images/s "
        f"({'one run' if n_rep == 1 else f'median of {n_rep} runs'}) against as given "
        f"{a_rep[m + 'images_per_s']:.1f} images/s: {rep_x:.2f}x, {rep_x / main_x:.2f} times the main speed-up"
        + (f", {'inside' if per_run.min() <= rep_x <= per_run.max() else 'outside'} the main fixed runs' range."
           if N_FIXED > 1 else ".")
    ))  # fmt: skip
    main_hosts = set(FIXED_RUNS["host"]) | {a_main["host"]}
    rep_hosts = set(used["fixed"]["host"]) | {a_rep["host"]}
    if main_hosts & rep_hosts:
        lines.append(
            f"Same host: the replicate ran on {', '.join(sorted(main_hosts & rep_hosts))}, as the main "
            "runs did, so it repeats the measurement there and says nothing about a second host."
        )
    elif main_x <= 1:
        lines.append(f"The main log shows no speed-up ({main_x:.2f}x), so there is none to hold.")
    else:
        holds = rep_x > 1
        lines.append(
            f"The speed-up {'holds' if holds else 'does not hold'} on the second host: "
            f"{rep_x:.2f}x there ("
            + (
                f"above 1.0, as the main {main_x:.2f}x is"
                if holds
                else f"not above 1.0, against the main {main_x:.2f}x"
            )
            + f"), {rep_x / main_x:.2f} times the main speed-up."
        )
    return table, lines


REPLICATE_TABLE, REPLICATE_LINES = replicate_comparison()
PROVENANCE = provenance_table()
# GPU tags of one 4-GPU H200 host, whose runs went four at a time, one process per GPU, each pinned
# to 16 of the host's 64 cores (env.cpu_count reads 64).
H200_HOST_TAGS = {"0bd5e7f1", "dc51dc67", "a24f1084", "24c7bc89"}
SHARED_HOST = sorted(
    H200_HOST_TAGS & {t for tags in PROVENANCE.get("GPU tag(s)", []) for t in tags.split(", ")}
)
