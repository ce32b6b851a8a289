"""Loads the Task 1 logs (reports/results/task1/) for task1_loss_scaling.ipynb.

Builds, for Part 1 (UNet on Carvana-like images), the runs, steps, epochs and step timings of
train_unet.py per precision mode, and for Part 2 (GPT-like LM) the per-step, final and timing
records of lm_precision.py per precision setup; the held-out quality of each setup over its
seeds, the per-step loss, scale and skip tables by (setup, seed), the setups whose curves are
one trajectory, and the runs that end far outside the other seeds' range; and the rows of the
report's answers and targets tables; and, for the appendix, where each log was made. It
displays nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import numpy as np
import pandas as pd
from loaders.replicates import log_provenance  # reports/loaders/ (cwd: reports/)

from effdl.answers import Answer, Target
from effdl.results import device_name, load_results, read_records, results_dir
from effdl.tables import MISSING, is_missing, measured, spread

RESULTS = results_dir("results")
R = RESULTS / "task1"
MODES = [
    "fp32",
    "amp_noscale",
    "amp_torch_scaler",
    "amp_static",
    "amp_dynamic",
    "own_autocast_dynamic",
]
SETUPS = [
    "fp32",
    "pure_fp16",
    "amp_static",
    "amp_dynamic",
    "own_autocast_torch_scaler",
    "torch_autocast_torch_scaler",
]
REF = "torch_autocast_torch_scaler"


def latest(df, keys=("variant", "config.seed")):
    """Per run (mode, seed), only the rows of its most recent invocation of the script."""
    newest = df.groupby(list(keys))["config.run_id"].transform("max")
    return df[df["config.run_id"] == newest].copy()


def latest_run(df):
    """Only the rows of the most recent invocation of the script that wrote ``df``."""
    return df[df["config.run_id"] == df["config.run_id"].max()]


def numeric(df, *cols):
    """Logged floats may be the string 'nan' (a diverged run): make the columns numeric (those
    the log has)."""
    for c in cols:
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce")
    return df


# UNet logs
runs = latest(load_results(R, "unet_runs.jsonl"))
steps = latest(load_results(R, "unet_steps.jsonl"))
epochs = latest(load_results(R, "unet_epochs.jsonl"))
timing = latest(load_results(R, "unet_timing.jsonl"), keys=("variant",))
env = runs.sort_values("config.run_id").iloc[-1]
order = [m for m in MODES if m in set(runs["variant"])]
# The UNet records name their data in config.data when the run was given --data; a run whose
# config has no such field ran on the script's generated Carvana-like set.
if "config.data" in runs and runs["config.data"].notna().any():
    UNET_DATA = f"real Carvana ({runs['config.data'].dropna().iloc[0]})"
else:
    UNET_DATA = "generated Carvana-like images (no --data in the run's config)"
UNET_GPU = device_name(env)

# LM log: the latest invocation only
lm = latest_run(load_results(R, "lm_precision.jsonl"))
lm_steps, lm_final, lm_timing, lm_eval = (
    lm[lm["config.kind"] == k].copy() for k in ("step", "final", "timing", "eval")
)
numeric(lm_steps, "metrics.loss", "metrics.accuracy", "metrics.scale", "metrics.grad_norm")
numeric(lm_eval, "metrics.step", "metrics.heldout_loss", "metrics.heldout_accuracy")
numeric(lm_final, "metrics.heldout_loss", "metrics.heldout_accuracy", "metrics.final_train_loss")
corpus = lm["config.corpus"].iloc[0]
LM_DATA = (
    f"generated WikiText-like corpus, `{corpus}`"
    if str(corpus).startswith("synthetic")
    else f"real text, `{corpus}`"
)
LM_GPU = device_name(
    lm[lm["env.gpu"].notna()].iloc[0] if lm["env.gpu"].notna().any() else lm.iloc[0]
)
lm_final["diverged"] = lm_final["metrics.diverged"].isin([True, "True"])
lm_final["rerun"] = lm_final["config.role"] != "main"  # "rerun" (other init seeds) or "noise"
fin = lm_final.set_index(["variant", "config.seed"])
SOURCE = f"UNet: {UNET_GPU}, {UNET_DATA}. LM: {LM_GPU}, {LM_DATA}."

# UNet: validation accuracy per mode over seeds, and step time
g = runs.groupby("variant")
unet = pd.DataFrame(
    {
        "seeds": g["config.seed"].nunique(),
        "val_acc_mean": g["metrics.val_accuracy"].mean(),
        "val_acc_min": g["metrics.val_accuracy"].min(),
        "zero_grad": steps.groupby("variant")["metrics.zero_grad_fraction"].mean(),
    }
).reindex(order)
ut = timing.set_index("variant")["metrics.step_s_median"]


def unet_acc(m):
    r = unet.loc[m]
    verdict = "0.985+ reached" if r["val_acc_min"] >= 0.985 else "0.985 not reached"
    return (
        f"validation pixel accuracy {r['val_acc_mean']:.4f} (worst of {int(r['seeds'])} seeds "
        f"{r['val_acc_min']:.4f}) after {int(env['config.epochs'])} epochs: {verdict}"
    )


# LM: held-out quality per setup over the init seeds present (runs that did not diverge)
Q = pd.DataFrame(
    spread(
        lm_final[~lm_final["diverged"]].to_dict("records"),
        "variant",
        ("metrics.heldout_loss", "metrics.heldout_accuracy"),
    )
)
Q = Q.set_index("variant") if len(Q) else pd.DataFrame(columns=["n"])
RUNS_PER_SETUP = lm_final.groupby("variant")["config.seed"].nunique()
DIVERGED = lm_final[lm_final["diverged"]].groupby("variant")["config.seed"].apply(list)


def seed_range(s, field="metrics.heldout_loss"):
    """min..max of ``field`` over the seeds of ``s`` that did not diverge, None without them."""
    if s not in Q.index:
        return None
    return Q.loc[s, f"{field}_min"], Q.loc[s, f"{field}_max"]


def paired(a, b, field="metrics.heldout_loss"):
    """``field`` of setup ``a`` minus that of ``b``, per seed where neither diverged."""
    ok = lm_final[~lm_final["diverged"]].pivot_table(
        index="config.seed", columns="variant", values=field
    )
    if a not in ok or b not in ok:
        return pd.Series(dtype=float)
    d = (ok[a] - ok[b]).dropna()
    d.index = d.index.astype(int)
    return d


def dynamic_gain():
    """Does AMP + own DynamicGradScaler end better than pure fp16 and than AMP + static?

    Over pure fp16: whether fp16 diverges at every seed while amp_dynamic trains. Over AMP +
    static: the held-out loss difference per seed (same init, same batches), judged against the
    wider of the two setups' seed ranges (their spread); no verdict with fewer than two seeds.
    """
    if "amp_dynamic" not in Q.index:
        return MISSING
    n16 = int(RUNS_PER_SETUP.get("pure_fp16", 0))
    n16_bad = len(DIVERGED.get("pure_fp16", []))
    if n16 == 0:
        parts = [f"over pure fp16: {MISSING}"]
    elif n16_bad == n16:
        parts = [f"over pure fp16 yes (fp16 diverges at {n16_bad} of {n16} seeds)"]
    else:
        parts = [f"over pure fp16: fp16 trains at {n16 - n16_bad} of {n16} seeds"]
    d_loss = paired("amp_dynamic", "amp_static")
    if "amp_static" not in Q.index or d_loss.empty:
        return "; ".join([*parts, f"over AMP static: {MISSING}"])
    n, lower = len(d_loss), int((d_loss < 0).sum())
    detail = (
        f"held-out loss dynamic - static {', '.join(f'{round(d, 3) + 0:+.3f}' for d in d_loss)} "
        f"nats at seed{'s' if n > 1 else ''} {', '.join(map(str, d_loss.index))}"
    )
    if n < 2:
        parts.append(f"over AMP static no verdict, one common seed ({detail})")
        return "; ".join(parts)
    band = max(hi - lo for lo, hi in (seed_range("amp_dynamic"), seed_range("amp_static")))
    diff = d_loss.mean()
    beyond = "beyond" if abs(diff) > band else "within"
    detail += f" (mean {diff:+.3f}, {beyond} the seed range {band:.3f})"
    if lower == n and -diff > band:
        verdict = f"yes, lower at all {n} seeds: {detail}"
    else:
        verdict = f"no, lower at {lower} of {n} seeds: {detail}"
    parts.append(f"over AMP static {verdict}")
    return "; ".join(parts)


others = sorted(set(DIVERGED.index) - {"pure_fp16"})
no_div = (
    "no run diverged besides pure fp16"
    if not others
    else "diverged: "
    + ", ".join(f"{s} seed(s) {', '.join(str(int(x)) for x in DIVERGED[s])}" for s in others)
)

# LM: the per-step tables, columns (setup, seed) of the runs the log holds
LOSS = lm_steps.pivot_table(
    index="metrics.step", columns=["variant", "config.seed"], values="metrics.loss", dropna=False
)
ACC = lm_steps.pivot_table(
    index="metrics.step",
    columns=["variant", "config.seed"],
    values="metrics.accuracy",
    dropna=False,
)
SCALE = lm_steps.pivot_table(
    index="metrics.step", columns=["variant", "config.seed"], values="metrics.scale"
)
SKIP = lm_steps.assign(sk=lm_steps["metrics.skipped"].isin([True, "True"])).pivot_table(
    index="metrics.step", columns=["variant", "config.seed"], values="sk"
)
RUN_KEYS = list(dict.fromkeys(zip(lm_steps["variant"], lm_steps["config.seed"], strict=True)))
LOSS, ACC, SCALE, SKIP = (t.reindex(columns=RUN_KEYS) for t in (LOSS, ACC, SCALE, SKIP))
SEEDS = sorted(int(x) for x in lm_final["config.seed"].unique())
MAIN_SEED = int(lm_final.loc[lm_final["config.role"] == "main", "config.seed"].min())
TOL = 1e-6  # nats: curves this close at every step are one trajectory (the own-Autocast target)


def same_curve(a, b):
    """Two per-step loss curves within TOL of each other at every step (NaN where both are)."""
    return a.index.equals(b.index) and np.allclose(a, b, rtol=0, atol=TOL, equal_nan=True)


def trajectories(seed, setups=SETUPS):
    """The setups of ``seed`` grouped by identical loss curves (within TOL), in SETUPS order."""
    groups = []
    for s in setups:
        if (s, seed) not in LOSS.columns:
            continue
        g = next((g for g in groups if same_curve(LOSS[(g[0], seed)], LOSS[(s, seed)])), None)
        if g is None:
            groups.append([s])
        else:
            g.append(s)
    return groups


def far_runs():
    """Runs whose held-out loss lies above the range of the other seeds' runs (all setups that
    did not diverge) by more than that range's width: a run that ends far outside what the
    other seeds reach. Judged only where the other runs come from at least two seeds.

    Returns (the judged runs with their band, the far ones among them).
    """
    ok = lm_final[~lm_final["diverged"]]
    judged = []
    for seed in SEEDS:
        rest = ok[ok["config.seed"] != seed]
        if rest["config.seed"].nunique() < 2:
            continue
        lo, hi = rest["metrics.heldout_loss"].min(), rest["metrics.heldout_loss"].max()
        alo, ahi = rest["metrics.heldout_accuracy"].min(), rest["metrics.heldout_accuracy"].max()
        mine = ok[ok["config.seed"] == seed].assign(
            band_lo=lo, band_hi=hi, acc_lo=alo, acc_hi=ahi, band_seeds=len(set(rest["config.seed"]))
        )
        judged.append(mine.assign(far=mine["metrics.heldout_loss"] > hi + (hi - lo)))
    judged = pd.concat(judged) if judged else ok.iloc[:0].assign(far=False)
    return judged, judged[judged["far"]]


JUDGED, FAR = far_runs()


def far_answer():
    """The answers row on runs far outside the other seeds: which, and whether fp32 is one."""
    if JUDGED.empty:
        return f"{MISSING}: fewer than three seeds of trained runs in the log"
    if FAR.empty:
        return "no run ends above the other seeds' held-out loss range by more than its width"
    parts = []
    for seed, g in FAR.groupby("config.seed"):
        g = g.set_index("variant")
        band = g.iloc[0]
        runs = [
            f"{t[0]}{' (+' + str(len(t) - 1) + ' identical)' if len(t) > 1 else ''} "
            f"{g.loc[t[0], 'metrics.heldout_loss']:.3f}"
            for t in trajectories(int(seed), list(g.index))
        ]
        text = (
            f"seed {int(seed)}: {', '.join(runs)} nats held-out loss against "
            f"{band['band_lo']:.3f}..{band['band_hi']:.3f} for the other seeds"
        )
        text += (
            "; fp32 is one of them, so the collapse is not fp16's"
            if "fp32" in g.index
            else "; fp32 is not one of them"
        )
        parts.append(text)
    return "; ".join(parts)


# LM: one gradient computation per setup, smallest timing batch
tim = lm_timing.assign(rows=lm_timing["config.batch_shape"].map(lambda s: s[0]))
grad_ms = tim.pivot(index="variant", columns="rows", values="metrics.grad_s_median") * 1e3
small = grad_ms.columns.min()
seq_of = {s[0]: s[1] for s in tim["config.batch_shape"]}
gap_own = lm_final.loc[
    (lm_final["variant"] == "own_autocast_torch_scaler") & ~lm_final["rerun"],
    "metrics.curve_gap_to_reference",
]
gap_own = float(gap_own.iloc[0]) if len(gap_own) else np.nan
own_vs_torch = ", ".join(
    f"{grad_ms.loc['own_autocast_torch_scaler', b] / grad_ms.loc[REF, b]:.3f}x at {b}x{seq_of[b]}"
    for b in grad_ms.columns
)


def quality_all():
    """Held-out loss of the four setups the seed compares, means over seeds (or divergence)."""
    out = []
    for name, setup in [("fp32", "fp32"), ("fp16", "pure_fp16"), ("static", "amp_static"),
                        ("dynamic", "amp_dynamic")]:  # fmt: skip
        n = int(RUNS_PER_SETUP.get(setup, 0))
        bad = len(DIVERGED.get(setup, []))
        if n == 0:
            out.append(f"{name} {MISSING}")
        elif bad == n:
            out.append(f"{name} diverged at {n} of {n} seeds")
        else:
            out.append(f"{name} {Q.loc[setup, 'metrics.heldout_loss_mean']:.3f}")
    return f"held-out loss {', '.join(out)} nats (means over {len(SEEDS)} seeds)"


QUALITY = "Held-out quality per setup"
answers = [
    Answer("UNet, static loss scaling", unet_acc("amp_static"), "Accuracy and step time per mode"),
    Answer(
        "UNet, dynamic loss scaling", unet_acc("amp_dynamic"), "Accuracy and step time per mode"
    ),
    Answer(
        "UNet, AMP with vs without a scaler",
        f"val. accuracy {unet.loc['amp_noscale', 'val_acc_mean']:.4f} without a scaler "
        f"({unet.loc['amp_noscale', 'zero_grad']:.0%} of gradient elements zero), "
        f"{unet.loc['amp_torch_scaler', 'val_acc_mean']:.4f} with torch's",
        "Loss, scale and zero-gradient curves",
    ),
    Answer("LM: fp32, fp16, AMP static, AMP dynamic", quality_all(), QUALITY),
    Answer("No divergence except (maybe) fp16", no_div, QUALITY),
    Answer("Dynamic scaling gives a quality gain", dynamic_gain(), QUALITY),
    Answer(
        "Runs far from the other seeds", far_answer(), "Runs that end far outside the other seeds"
    ),
    Answer(
        "Own Autocast",
        f"loss curve {measured(gap_own, '.1g')} nats from torch.autocast's; gradient time {own_vs_torch}",
        "Where own Autocast's time goes",
    ),
    Answer(
        f"Time of one gradient computation ({small}x{seq_of[small]} tokens)",
        ", ".join(f"{s} {grad_ms.loc[s, small]:.1f} ms" for s in SETUPS[:4] if s in grad_ms.index),
        "Time of one gradient computation",
    ),
]

step_ratio = ut["amp_dynamic"] / ut["amp_torch_scaler"]


def lm_step_ratios(setup):
    """{timing batch rows: ``setup``'s LM training-step median over the reference's}."""
    rows = tim[tim["variant"] == setup]
    return dict(
        zip(rows["rows"], rows["metrics.step_ratio_to_reference"].astype(float), strict=True)
    )


targets = [
    Target(
        "own DynamicGradScaler's UNet step within 3% of torch GradScaler's",
        f"{step_ratio:.3f}x",
        bool(step_ratio <= 1.03),
    ),
    *[
        Target(
            f"{what}'s LM training step within {limit - 1:.0%} of {ref_name}'s, every timing batch",
            ", ".join(f"{r:.3f}x at {b}x{seq_of[b]}" for b, r in ratios.items()),
            bool(max(ratios.values()) <= limit),
        )
        for what, ref_name, limit, ratios in [
            ("own Autocast", "torch.autocast", 1.05, lm_step_ratios("own_autocast_torch_scaler")),
            ("own DynamicGradScaler", "torch GradScaler", 1.03, lm_step_ratios("amp_dynamic")),
        ]
        if ratios
    ],
    Target(
        "own Autocast + torch GradScaler: the LM loss curve of torch.autocast (gap < 1e-6)",
        None if is_missing(gap_own) else f"{gap_own:.1g} nats",
        None if is_missing(gap_own) else bool(gap_own < 1e-6),
    ),
]


# Appendix: where each log the report reads was made.
def provenance():
    """One row per log the report reads (task1/, its probes, the GEMM reference rates): git sha, GPU model, GPU tag(s), runs
    (distinct run ids)."""
    paths = [*sorted(R.rglob("*.jsonl*")), *sorted((RESULTS / "ceilings").glob("*.jsonl*"))]
    logs = {str(p.relative_to(RESULTS)): [r.get("env", {}) for r in read_records(p)] for p in paths}
    return log_provenance(logs).set_index("log")
