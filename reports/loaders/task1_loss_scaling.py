"""Loads the Task 1 logs (reports/results/task1/) for task1_loss_scaling.ipynb.

Builds, for Part 1 (UNet on Carvana-like images), the runs, steps, epochs and step timings of
train_unet.py per precision mode, and for Part 2 (GPT-like LM) the per-step, final and timing
records of lm_precision.py per precision setup; the held-out quality of each setup over its
seeds, the per-step loss, scale and skip tables by (setup, seed), the setups whose curves are
one trajectory, and the runs that end far outside the other seeds' range; and the rows of the
report's answers and targets tables; and, for the appendix, the headline timing ratios of the
timing logs set beside the same ratios from replicate logs of another host, where those exist
(``*_replicate.jsonl``, read only there: the main sections load the main logs by their exact
names). It displays nothing: the notebook runs it with ``%run -i``
and shows the tables.
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


def latest_run(df):
    """Only the rows of the most recent invocation of the script that wrote ``df``."""
    return df[df["config.run_id"] == df["config.run_id"].max()]


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
lm = latest_run(load_results(R, "lm_precision.jsonl"))
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
    static: the held-out loss and accuracy differences per seed (same init, same batches),
    judged against the wider of the two setups' seed ranges (their spread). With fewer than
    two common seeds there is no spread to judge by, and no verdict.
    """
    if "amp_dynamic" not in Q.index:
        return MISSING
    n16 = int(RUNS_PER_SETUP.get("pure_fp16", 0))
    n16_bad = len(DIVERGED.get("pure_fp16", []))
    n_dyn = int(Q.loc["amp_dynamic", "n"])
    if n16 == 0:
        parts = [f"over pure fp16: {MISSING}"]
    elif n16_bad == n16:
        parts = [
            f"over pure fp16: yes (fp16 diverges at {n16_bad} of {n16} seeds, amp_dynamic "
            f"trains at {n_dyn} of {int(RUNS_PER_SETUP['amp_dynamic'])})"
        ]
    else:
        parts = [f"over pure fp16: fp16 trains at {n16 - n16_bad} of {n16} seeds"]
    d_loss = paired("amp_dynamic", "amp_static")
    if "amp_static" not in Q.index or d_loss.empty:
        return "; ".join([*parts, f"over AMP static: {MISSING}"])
    d_acc = paired("amp_dynamic", "amp_static", "metrics.heldout_accuracy")
    n, lower = len(d_loss), int((d_loss < 0).sum())
    detail = (
        f"held-out loss dynamic - static {', '.join(f'{round(d, 3) + 0:+.3f}' for d in d_loss)} nats at "
        f"seed{'s' if n > 1 else ''} {', '.join(map(str, d_loss.index))}, accuracy "
        f"{', '.join(f'{round(d, 3) + 0:+.3f}' for d in d_acc)}"
    )
    if n < 2:
        parts.append(f"over AMP static: no verdict, one common seed ({detail})")
        return "; ".join(parts)
    band = max(hi - lo for lo, hi in (seed_range("amp_dynamic"), seed_range("amp_static")))
    diff = d_loss.mean()
    beyond = "beyond" if abs(diff) > band else "within"
    spread_text = (
        f"the mean difference ({diff:+.3f}) is {beyond} the wider seed range of the two "
        f"setups ({band:.3f})"
    )
    if lower == n and -diff > band:
        verdict = f"yes, dynamic lower at all {n} seeds ({detail}); {spread_text}"
    elif lower == 0:
        verdict = f"no, dynamic lower at none of the {n} seeds ({detail}); {spread_text}"
    else:
        verdict = f"no gain beyond the seed spread: dynamic lower at {lower} of {n} seeds ({detail}); {spread_text}"
    parts.append(f"over AMP static: {verdict}")
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
        seed = int(seed)
        g = g.set_index("variant")
        band = g.iloc[0]
        other = sorted(set(SEEDS) - {seed})
        runs = [
            " = ".join(t)
            + (" (one trajectory)" if len(t) > 1 else "")
            + f" at held-out loss {g.loc[t[0], 'metrics.heldout_loss']:.3f}, accuracy "
            f"{g.loc[t[0], 'metrics.heldout_accuracy']:.3f}"
            for t in trajectories(seed, list(g.index))
        ]
        text = (
            f"seed {seed}: {'; '.join(runs)}, against {band['band_lo']:.3f}..{band['band_hi']:.3f} "
            f"and {band['acc_lo']:.3f}..{band['acc_hi']:.3f} for every run of seeds "
            f"{', '.join(map(str, other))}"
        )
        kept = JUDGED[(JUDGED["config.seed"] == seed) & ~JUDGED["far"]]
        if len(kept):
            text += (
                "; "
                + ", ".join(
                    f"{r['variant']} seed {seed} ends at {r['metrics.heldout_loss']:.3f}, "
                    f"{r['metrics.heldout_accuracy']:.3f}"
                    for _, r in kept.iterrows()
                )
                + ", within one range width of that range"
            )
        text += (
            ". fp32 is among the far runs, so fp16 is not needed for this collapse"
            if "fp32" in g.index
            else ". fp32 is not among the far runs"
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
        "Runs far below the other seeds",
        far_answer(),
        "Runs that end far outside the other seeds",
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

# Appendix: the headline timing ratios from replicate logs of a second host, beside the main
# logs' ones. A replicate log is written by the same script on another host and renamed; it is
# read only here, so the sections above never mix hosts.
REPLICATES = {  # replicate log: (main log, what it replicates)
    "unet_timing_replicate.jsonl": ("unet_timing.jsonl", "UNet training-step timing"),
    "lm_precision_timing_replicate.jsonl": ("lm_precision.jsonl", "LM timing records"),
}
# Config fields that do not change what a timing measures: the run's identity and device index,
# and the length and learning rate of the training runs (the timing phase builds fresh models
# and times its own fixed number of steps, which is compared: the step_s_n/grad_s_n below).
NOT_MEASUREMENT = ("run_id", "device", "epochs", "steps", "lr", "warmup_steps", "seed", "role")
TIMED_COUNTS = ("metrics.step_s_n", "metrics.grad_s_n")
# The ratios the report states, each the ratio of two medians of one timing log:
# (name, which median: step or grad, numerator, denominator); the LM's at each timing batch.
UNET_RATIOS = [
    ("own DynamicGradScaler / torch GradScaler", "step", "amp_dynamic", "amp_torch_scaler"),
    ("own StaticGradScaler / torch GradScaler", "step", "amp_static", "amp_torch_scaler"),
    ("own Autocast / torch.autocast (own DynamicGradScaler)", "step", "own_autocast_dynamic",
     "amp_dynamic"),
    ("fp32 / AMP (torch GradScaler)", "step", "fp32", "amp_torch_scaler"),
]  # fmt: skip
LM_RATIOS = [
    ("own Autocast / torch.autocast", "grad", "own_autocast_torch_scaler", REF),
    ("own Autocast / torch.autocast", "step", "own_autocast_torch_scaler", REF),
    ("own DynamicGradScaler / torch GradScaler", "step", "amp_dynamic", REF),
    ("own StaticGradScaler / torch GradScaler", "step", "amp_static", REF),
    ("fp32 / AMP (torch.autocast + torch GradScaler)", "grad", "fp32", REF),
]
QUANTITY = {"step": "training step", "grad": "gradient computation"}


def unet_timing_records(df):
    """The UNet timing records the report reads, by mode: the latest run of each mode."""
    return latest(df, keys=("variant",)).set_index("variant", drop=False)


def lm_timing_records(df):
    """The LM timing records the report reads, by (batch, setup): the latest invocation's."""
    t = latest_run(df)
    t = t[t["config.kind"] == "timing"]
    batch = t["config.batch_shape"].map(lambda s: "x".join(map(str, s)))
    return t.set_index([batch.rename("batch"), t["variant"]], drop=False)


def measurement(row):
    """The config fields (and timed-step counts) of a record that define its measurement."""
    fields = {
        c.removeprefix("config."): row[c]
        for c in row.index
        if c.startswith("config.") and c.removeprefix("config.") not in NOT_MEASUREMENT
    }
    fields.update({c.removeprefix("metrics."): row[c] for c in TIMED_COUNTS if c in row.index})
    return {k: v for k, v in fields.items() if not is_missing(v)}


def config_gaps(main_row, rep_row):
    """The measurement fields on which two records differ, as 'field main vs replicate'."""
    a, b = measurement(main_row), measurement(rep_row)
    return [
        f"{k} {a.get(k, '-')} vs {b.get(k, '-')}"
        for k in sorted(set(a) | set(b))
        if a.get(k, "-") != b.get(k, "-")
    ]


def ratio_of(records, key_num, key_den, quantity):
    """Median of ``key_num`` / median of ``key_den`` (NaN where either is not in the log), and
    the two records."""
    if key_num not in records.index or key_den not in records.index:
        return np.nan, []
    rows = [records.loc[key_num], records.loc[key_den]]
    num, den = (pd.to_numeric(r.get(f"metrics.{quantity}_s_median"), errors="coerce") for r in rows)
    return num / den, rows


def origin(row):
    """GPU name, host id (env.gpu_id) and git sha (7 characters) of a record."""
    host = row.get("env.gpu_id")
    sha = row.get("env.git_sha")
    return (
        device_name(row),
        None if is_missing(host) else str(host),
        None if is_missing(sha) else str(sha)[:7],
    )


def verdict(main_value, rep_value, main_rows, rep_rows):
    """Whether a ratio holds on the second host: the replicate's value on the same side of 1.0
    as the main log's; no verdict where the records' measurements differ or the replicate comes
    from the main log's host."""
    if is_missing(main_value):
        return "not in the main log"
    if is_missing(rep_value):
        return f"{MISSING} in the replicate log"
    gaps = [g for m, r in zip(main_rows, rep_rows, strict=True) for g in config_gaps(m, r)]
    if gaps:
        return "not compared, the configs differ: " + "; ".join(dict.fromkeys(gaps))
    hosts = {origin(r)[1] for r in main_rows}, {origin(r)[1] for r in rep_rows}
    if None in hosts[0] | hosts[1]:
        return "no verdict: a record names no host (env.gpu_id), so the hosts cannot be told apart"
    if hosts[0] & hosts[1]:
        return "no verdict: the replicate is from the same host as the main log, not a second host"
    side = lambda v: int(v > 1) - int(v < 1)  # noqa: E731
    if side(main_value) == side(rep_value):
        return "holds on the second host"
    return "does not hold on the second host (the other side of 1.0)"


def replicate_rows(main, rep, specs):
    """One row per headline ratio in ``specs`` ((label, quantity, numerator key, denominator
    key), keys as the records are indexed): the main and replicate values, their relative
    difference, each side's origin and the verdict."""
    rows = []
    for label, quantity, key_num, key_den in specs:
        m, m_rows = ratio_of(main, key_num, key_den, quantity)
        r, r_rows = ratio_of(rep, key_num, key_den, quantity)
        say = verdict(m, r, m_rows, r_rows)
        compared = not is_missing(m) and not is_missing(r) and not say.startswith("not ")
        m_from = origin(m_rows[0]) if m_rows else (None,) * 3
        r_from = origin(r_rows[0]) if r_rows else (None,) * 3
        rows.append(
            {
                "ratio": label,
                "main": m,
                "replicate": r if compared else np.nan,
                "relative difference": f"{round(r / m - 1, 3) + 0:+.1%}" if compared else "-",
                "main GPU": m_from[0],
                "main host": m_from[1],
                "main sha": m_from[2],
                "replicate GPU": r_from[0],
                "replicate host": r_from[1],
                "replicate sha": r_from[2],
                "verdict": say,
            }
        )
    return rows


def unet_specs():
    """UNET_RATIOS as labelled specs keyed by mode."""
    return [(f"UNet {QUANTITY[q]}: {name}", q, a, b) for name, q, a, b in UNET_RATIOS]


def lm_specs(records):
    """LM_RATIOS at each timing batch of ``records`` (the main log's), keyed by (batch, setup)."""
    return [
        (f"LM {QUANTITY[q]} at {b}: {name}", q, (b, a), (b, d))
        for b in dict.fromkeys(records.index.get_level_values("batch"))
        for name, q, a, d in LM_RATIOS
    ]


def compare_replicate(name):
    """(one line on the replicate log ``name``, its table rows); never raises: a log that is
    absent is not measured, one that cannot be compared says why."""
    main_name, what = REPLICATES[name]
    head = f"{name} ({what} on a second host)"
    try:
        if not any((R / n).exists() for n in (name, name + ".gz")):
            return f"{head}: {MISSING}, the log is absent.", []
        raw = load_results(R, name)
        if name.startswith("unet"):
            main, rep = unet_timing_records(timing), unet_timing_records(raw)
            rows = replicate_rows(main, rep, unet_specs())
        else:
            main, rep = lm_timing_records(lm), lm_timing_records(raw)
            rows = replicate_rows(main, rep, lm_specs(main))
    except Exception as e:  # a replicate log that cannot be compared must not stop the report
        return f"{head}: not compared, {type(e).__name__}: {e}", []
    held = sum(r["verdict"].startswith("holds") for r in rows)
    judged = held + sum(r["verdict"].startswith("does not hold") for r in rows)
    line = f"{head}: {len(rep)} timing records beside the {len(main)} of {main_name}; "
    same = {r["replicate host"] for r in rows if "same host" in r["verdict"]}
    if same and not judged:
        line += (
            f"from the main log's host (env.gpu_id {', '.join(sorted(same))}), not a second "
            "host: no verdicts."
        )
    else:
        line += (
            f"{held} of the {len(rows)} headline ratios hold on the second host"
            + (f", {len(rows) - judged} without a verdict" if judged < len(rows) else "")
            + "."
        )
    return line, rows


REPLICATE_LINES, _rows = [], []
for _name in REPLICATES:
    _line, _r = compare_replicate(_name)
    REPLICATE_LINES.append(_line)
    _rows += _r
REPLICATE_TABLE = pd.DataFrame(_rows).set_index("ratio") if _rows else None
