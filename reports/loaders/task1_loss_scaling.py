"""Loads the Task 1 logs (reports/results/task1/) for task1_loss_scaling.ipynb.

Builds, for Part 1 (UNet on Carvana-like images), the runs, steps, epochs and step timings of
train_unet.py per precision mode, and for Part 2 (GPT-like LM) the per-step, final and timing
records of lm_precision.py per precision setup; the held-out quality of each setup over its
seeds; and the rows of the report's answers and targets tables. It displays nothing: the
notebook runs it with ``%run -i`` and shows the tables.
"""

import numpy as np
import pandas as pd

from effdl.answers import Answer, Target
from effdl.results import device_name, load_results, results_dir
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


def numeric(df, *cols):
    """Logged floats may be the string 'nan' (a diverged run): make the columns numeric."""
    for c in cols:
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
lm = load_results(R, "lm_precision.jsonl")
lm = lm[lm["config.run_id"] == lm["config.run_id"].max()]
lm_steps, lm_final, lm_timing = (
    lm[lm["config.kind"] == k].copy() for k in ("step", "final", "timing")
)
numeric(lm_steps, "metrics.loss", "metrics.accuracy", "metrics.scale")
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


def lm_quality(s):
    """Held-out loss and accuracy of ``s``: the mean and min..max over its seeds."""
    n = int(RUNS_PER_SETUP.get(s, 0))
    if n == 0:
        return MISSING
    bad = DIVERGED.get(s, [])
    if len(bad) == n:
        first = lm_final.loc[lm_final["variant"] == s, "metrics.diverged_at_step"].min()
        return f"diverged in {n} of {n} runs (loss NaN from step {measured(first, '.0f')})"
    r = Q.loc[s]
    rng = lambda f, spec: (  # noqa: E731
        f"{r[f + '_mean']:{spec}}"
        + (f" ({r[f + '_min']:{spec}}..{r[f + '_max']:{spec}})" if r["n"] > 1 else "")
    )
    seeds = "one seed" if r["n"] == 1 else f"over {int(r['n'])} seeds"
    text = (
        f"held-out loss {rng('metrics.heldout_loss', '.3f')}, accuracy "
        f"{rng('metrics.heldout_accuracy', '.3f')}, {seeds}"
    )
    return text + (f"; {len(bad)} of {n} diverged" if bad else "")


def loss_range(s):
    if s not in Q.index:
        return None
    return Q.loc[s, "metrics.heldout_loss_min"], Q.loc[s, "metrics.heldout_loss_max"]


def dynamic_gain():
    """Does AMP + own DynamicGradScaler end better than pure fp16 and than AMP + static?

    The gap to AMP + static is judged by the seed spread of these two setups only: the
    reference setup's seed 0 is the same trajectory as amp_dynamic's seed 0, so a band from the
    reference's seeds would be widened by the very run it judges. With fewer than two seeds of
    either setup there is no spread to judge by, and no verdict.
    """
    dyn, stat = loss_range("amp_dynamic"), loss_range("amp_static")
    if dyn is None:
        return MISSING
    fp16_dead = len(DIVERGED.get("pure_fp16", [])) == RUNS_PER_SETUP.get("pure_fp16", -1)
    parts = ["over pure fp16: " + ("yes (fp16 diverges)" if fp16_dead else "fp16 trains too")]
    if stat is not None:
        n_dyn, n_stat = (int(Q.loc[v, "n"]) for v in ("amp_dynamic", "amp_static"))
        diff = (
            Q.loc["amp_static", "metrics.heldout_loss_mean"]
            - Q.loc["amp_dynamic", "metrics.heldout_loss_mean"]
        )
        if min(n_dyn, n_stat) < 2:
            seeds = (
                "one seed of each"
                if n_dyn == n_stat == 1
                else f"{n_dyn} seed(s) of amp_dynamic, {n_stat} of amp_static"
            )
            verdict = f"no verdict: {seeds}, so no seed spread of these setups to judge the gap by"
        else:
            band = max(hi - lo for lo, hi in (dyn, stat))  # the wider of their two seed ranges
            if abs(diff) <= band:
                verdict = f"no gain beyond their seed spread ({band:.3f})"
            else:
                verdict = (
                    "better" if diff > 0 else "worse"
                ) + f" beyond their seed spread ({band:.3f})"
        parts.append(
            f"over AMP static: loss {Q.loc['amp_dynamic', 'metrics.heldout_loss_mean']:.3f} "
            f"vs {Q.loc['amp_static', 'metrics.heldout_loss_mean']:.3f}, {verdict}"
        )
    return "; ".join(parts)


fp32_acc = Q["metrics.heldout_accuracy_mean"].get("fp32", np.nan)
COLLAPSED = lm_final[
    ~lm_final["diverged"] & (lm_final["metrics.heldout_accuracy"] < 0.5 * fp32_acc)
]  # runs that trained but ended far below fp32
others = sorted(set(DIVERGED.index) - {"pure_fp16"})
no_div = (
    "no run diverged besides pure fp16"
    if not others
    else "diverged: "
    + ", ".join(f"{s} seed(s) {', '.join(str(int(x)) for x in DIVERGED[s])}" for s in others)
)
if len(COLLAPSED):
    no_div += (
        f"; ended far below fp32 (accuracy <= {COLLAPSED['metrics.heldout_accuracy'].max():.3f}): "
        + "; ".join(
            f"{v} seed(s) {', '.join(str(int(x)) for x in g['config.seed'])}"
            for v, g in COLLAPSED.groupby("variant", sort=False)
        )
    )

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
answers = [
    Answer("UNet, static loss scaling", unet_acc("amp_static"), "Accuracy and step time per mode"),
    Answer(
        "UNet, dynamic loss scaling", unet_acc("amp_dynamic"), "Accuracy and step time per mode"
    ),
    Answer(
        "UNet, AMP with vs without a scaler",
        f"accuracy {unet.loc['amp_noscale', 'val_acc_mean']:.4f} without a scaler "
        f"({unet.loc['amp_noscale', 'zero_grad']:.0%} of gradient elements zero), "
        f"{unet.loc['amp_torch_scaler', 'val_acc_mean']:.4f} with torch's, "
        f"{unet.loc['fp32', 'val_acc_mean']:.4f} in fp32",
        "Loss, scale and zero-gradient curves",
    ),
    Answer(
        "UNet step, own scalers vs torch GradScaler",
        f"dynamic {ut['amp_dynamic'] / ut['amp_torch_scaler']:.3f}x, static "
        f"{ut['amp_static'] / ut['amp_torch_scaler']:.3f}x the step time",
        "Training-step time alone",
    ),
    Answer("LM quality, fp32", lm_quality("fp32"), "Held-out quality per setup"),
    Answer("LM quality, fp16", lm_quality("pure_fp16"), "Pure fp16 diverges at the first update"),
    Answer(
        "LM quality, AMP + StaticGradScaler", lm_quality("amp_static"), "Held-out quality per setup"
    ),
    Answer(
        "LM quality, AMP + DynamicGradScaler",
        lm_quality("amp_dynamic"),
        "Held-out quality per setup",
    ),
    Answer("Quality gain of dynamic scaling", dynamic_gain(), "Held-out quality per setup"),
    Answer("No divergence except fp16", no_div, "Held-out quality per setup"),
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
targets = [
    Target(
        "own DynamicGradScaler's UNet step within 3% of torch GradScaler's",
        f"{step_ratio:.3f}x",
        bool(step_ratio <= 1.03),
    ),
    Target(
        "own Autocast + torch GradScaler: the LM loss curve of torch.autocast (gap < 1e-6)",
        None if is_missing(gap_own) else f"{gap_own:.1g} nats",
        None if is_missing(gap_own) else bool(gap_own < 1e-6),
    ),
]
