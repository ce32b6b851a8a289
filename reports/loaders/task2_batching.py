"""Loads the Task 2 logs (reports/results/task2/) for task2_batching.ipynb.

Builds the mock-epoch records of every pipeline (BRAIN, BIG BRAIN, ULTRA DUPER BIG BRAIN per k
and with a token budget, packed rows) with their ratios to the ideal, one summary row per
variant, the repeated token-budget and packed epochs per GPU, the training, sampler-cost and
packing logs, the host and kernel probes, and the rows of the report's answers and targets
tables; for the last appendix, where each log was made. It displays nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import numpy as np
import pandas as pd
from loaders.replicates import log_provenance, log_records  # reports/loaders/ (cwd: reports/)

from effdl.answers import Answer, Target
from effdl.results import device_name, read_records, results_dir
from effdl.tables import measured

RESULTS = results_dir("results") / "task2"
PROBES = RESULTS / "probes"  # logs of task2_batching/probes/*.py
PERCENTILES = np.arange(0, 101, 5)  # the percentiles mock_epoch.py logs for every variant
NOT_MEASURED = "not measured"
TARGET_RATIO = 1.15  # our target: bucketed (token budget) and packed epochs within 15% of ideal
LABELS = {
    "brain": "BRAIN",
    "bigbrain": "BIG BRAIN",
    "ultra": "ULTRA DUPER BIG BRAIN",
    "packed_concat": "packed (concat)",
    "packed_bfd": "packed (BFD)",
}
# The rows of the main table: (variant as mock_epoch.py names it, pipeline, k, token budget).
EXPECTED = [("brain", "brain", None, None), ("bigbrain", "bigbrain", None, None)]
EXPECTED += [(f"ultra_k{k}", "ultra", k, None) for k in (1, 5, 10, 20, 50, 640)]
EXPECTED += [("ultra_k5_mt40960", "ultra", 5, 40960)]
EXPECTED += [(p, p, None, None) for p in ("packed_concat", "packed_bfd")]
BUDGET_VARIANTS = ["ultra_k5_mt40960", "packed_concat", "packed_bfd"]


def load(pattern, folder=RESULTS):
    # Every record of the main logs matching pattern (or their .gz form), or None if there are none.
    rows = log_records(folder, (pattern, pattern + ".gz"))
    if not rows:
        return None
    df = pd.DataFrame(rows)
    df["run"] = df["source"] + " @ " + df["env.time"].astype(str)  # one process = one env
    for name in ("metrics.peak_mem_gib", "metrics.step_peak_gib_median"):  # "nan" without a GPU
        if name in df:
            df[name] = pd.to_numeric(df[name], errors="coerce")
    return df


def col(df, name):
    # A metric column, NaN where a log does not have it.
    return df[name] if name in df else pd.Series(np.nan, index=df.index)


def device_of(df):
    gpus = sorted(df["env.gpu"].dropna().unique()) if "env.gpu" in df else []
    return ", ".join(gpus) if gpus else f"CPU ({df['env.cpu'].dropna().iloc[0]})"


def on_gpu(df):
    return df is not None and "env.gpu" in df and df["env.gpu"].notna().any()


def data_set(df):
    # The data set of a log, as every table states it.
    corpus = df["config.corpus"].dropna().iloc[0]
    kind = "generated" if str(corpus).startswith("synthetic") else "real"
    size = ""
    if "config.n_samples" in df and df["config.n_samples"].notna().any():
        r = df[df["config.n_samples"].notna()].iloc[0]
        size = f": {int(r['config.n_samples']):,} lines, {int(r['config.corpus_tokens']) / 1e6:.1f}M tokens"
    what = " (WikiText-103-sized)" if "wikitext103" in str(corpus) else ""
    return f"data set: {kind} corpus{what} `{corpus}`{size}"


def value_range(values, fmt):
    # "a-b" for a range of values, one value when they are all equal.
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}-{hi}"


def spread(values, fmt=".2f"):
    v = pd.Series(values).dropna()
    return f"{v.median():{fmt}} ({value_range(v, fmt)})" if len(v) else NOT_MEASURED


mock_all = load("*mock_epoch*.jsonl")
train_all = load("*train_pipelines*.jsonl")
costs_all = load("*sampler_costs*.jsonl")
packing_all = load("*packing*.jsonl")
host_probe = load("ultra_host.jsonl", PROBES) if PROBES.is_dir() else None
kernel_probe = load("profile_packed.jsonl", PROBES) if PROBES.is_dir() else None

epochs = mock_all[mock_all["config.pipeline"].isin(LABELS)] if mock_all is not None else None
if epochs is None or epochs.empty:
    raise SystemExit(f"no mock-epoch logs under {RESULTS}")
# Processes in time order: P1, P2, ... (a log file may hold several).
order = mock_all.drop_duplicates("run").sort_values("env.time")["run"].tolist()
PROC = {run: f"P{i + 1}" for i, run in enumerate(order)}
mock_all["proc"] = mock_all["run"].map(PROC)
# The device of each record (the GPU's name; a CPU run: the CPU): the repeated epochs are
# grouped by it, so a log that holds several GPU kinds judges each on its own.
mock_all["gpu"] = [device_name(r) for _, r in mock_all.iterrows()]
GPUS = list(dict.fromkeys(mock_all.sort_values("env.time")["gpu"]))  # in order of first record


def epochs_against_ideal(df):
    # The timed epochs of a mock-epoch log with the ratios every table reads: compute / ideal and
    # epoch / ideal against the dense batches timed right before each epoch (adjacent yardstick).
    e = df[df["config.pipeline"].isin(LABELS)].copy()
    e["compute_adj"] = col(e, "metrics.compute_over_ideal_adjacent")
    e["epoch_adj"] = col(e, "metrics.epoch_over_ideal_adjacent")
    return e


epochs = epochs_against_ideal(mock_all)
# The main sweep: the newest process that measured BRAIN. A variant it measured comes from it;
# any other variant from every epoch logged of it.
brain_runs = epochs.loc[epochs["variant"] == "brain"].sort_values("env.time")["run"]
MAIN_RUN = brain_runs.iloc[-1] if len(brain_runs) else None


def epochs_of(variant):
    e = epochs[epochs["variant"] == variant]
    in_main = e[e["run"] == MAIN_RUN]
    return in_main if len(in_main) else e


def summary(variant):
    # One main-table row: the median over the variant's epochs (min: smallest, max: largest).
    e = epochs_of(variant)
    if e.empty:
        return None
    med = e.median(numeric_only=True).astype(object)
    med["metrics.batch_s_min"] = e["metrics.batch_s_min"].min()
    med["metrics.batch_s_max"] = e["metrics.batch_s_max"].max()
    med["n_epochs"] = len(e)
    med["procs"] = ", ".join(sorted(e["proc"].unique(), key=lambda p: int(p[1:])))
    med["batch_pct"] = np.median(
        np.stack([np.asarray(p, float) for p in e["metrics.batch_s_percentiles"]]), axis=0
    )
    med["width_pct"] = np.median(
        np.stack([np.asarray(p, float) for p in e["metrics.width_percentiles"]]), axis=0
    )
    return med


rows = {v: summary(v) for v, *_ in EXPECTED}
MEASURED = [v for v, *_ in EXPECTED if rows[v] is not None]
S = pd.DataFrame({v: rows[v] for v in MEASURED}).T
GPU_LOG = on_gpu(epochs)
DATA = data_set(epochs)


def range_or_not(values, fmt=".3f"):
    v = pd.Series(values).dropna()
    return value_range(v, fmt) if len(v) else NOT_MEASURED


def gpu_rows(variants=BUDGET_VARIANTS):
    # Per variant, one row per GPU (median and range over its epochs), and one for all GPUs
    # when there are several.
    out = []
    for v in variants:
        e = epochs[epochs["variant"] == v]
        groups = list(e.groupby("gpu"))
        if len(groups) > 1:
            groups.append(("all GPUs", e))
        for gpu, h in groups:
            out.append(
                {
                    "variant": v,
                    "gpu": gpu,
                    "epochs": len(h),
                    "compute / ideal median": h["compute_adj"].median(),
                    "compute / ideal min-max": range_or_not(h["compute_adj"]),
                    "epoch / ideal median": h["epoch_adj"].median(),
                    "epoch / ideal min-max": range_or_not(h["epoch_adj"]),
                    "epochs within 15%": int((h["epoch_adj"] <= TARGET_RATIO).sum()),
                    "median batch (ms)": h["metrics.batch_s_median"].median() * 1e3,
                    "first batch (s)": col(h, "metrics.first_batch_s").median(),
                    "later waits (s)": col(h, "metrics.wait_s").median(),
                    "epoch - forwards (s)": (
                        h["metrics.epoch_s"] - h["metrics.compute_s"]
                    ).median(),
                }
            )
    return pd.DataFrame(out, columns=["variant", "gpu"] if not out else None)


HR = gpu_rows()
HR1 = HR[HR["gpu"] != "all GPUs"]  # the per-GPU rows
SOURCE = f"mock epoch: {device_of(epochs)}; {DATA}"
# One GPU for every judged number: the GPU with the most repeated epochs against the ideal (any
# other GPU's numbers are in the appendix).
MAIN_GPU = HR1.groupby("gpu")["epochs"].sum().idxmax() if len(HR1) else None
HR_MAIN = HR1[HR1["gpu"] == MAIN_GPU]


def batch_stats(v):
    if v not in S.index:
        return measured(None)
    r = {q: float(S.loc[v, f"metrics.batch_s_{q}"]) * 1e3 for q in ("min", "max", "mean", "median")}
    return (
        f"batch min {r['min']:.2f}, max {r['max']:.1f}, mean "
        f"{r['mean']:.2f}, median {r['median']:.2f} ms; epoch "
        f"{S.loc[v, 'metrics.epoch_s']:.1f} s"
    )


def val(v, what, spec, unit="", scale=1.0):
    return measured(S.loc[v, what] * scale if v in S.index else None, spec, unit)


ultra_k = [k for k in (1, 5, 10, 20, 50) if f"ultra_k{k}" in S.index]
slower = [
    k
    for k in ultra_k
    if "bigbrain" in S.index
    and S.loc[f"ultra_k{k}", "metrics.epoch_s"] > S.loc["bigbrain", "metrics.epoch_s"]
]
per_batch = lambda v: S.loc[v, "metrics.slots"] / S.loc[v, "metrics.n_batches"]  # noqa: E731
outside = S["metrics.epoch_s"] - S["metrics.compute_s"]  # epoch wall time beyond the forwards


def ultra_minimum():
    """No ULTRA k = 1..50 epoch slower than BIG BRAIN's, and what its batch minimum is: the
    fastest and the 5th-percentile batch and the narrowest batch's width (logged percentiles)."""
    vs = [f"ultra_k{k}" for k in ultra_k]
    fastest, median = (
        S.loc[vs, "metrics.batch_s_min"] * 1e3,
        S.loc[vs, "metrics.batch_s_median"] * 1e3,
    )
    p5 = [S.loc[v, "batch_pct"][1] * 1e3 for v in vs]
    narrowest = [S.loc[v, "width_pct"][0] for v in vs]
    return (
        f"none is (epochs {value_range(S.loc[vs, 'metrics.epoch_s'], '.1f')} s against "
        f"{S.loc['bigbrain', 'metrics.epoch_s']:.1f} s); their fastest batch "
        f"({value_range(fastest, '.2f')} ms, {value_range(median / fastest, '.0f')}x below the "
        f"median) is an outlier: the 5th percentile is {value_range(p5, '.2f')} ms and the "
        f"narrowest batch {value_range(narrowest, '.0f')} tokens wide"
    )


if slower:
    vs = [f"ultra_k{k}" for k in slower]
    bb = S.loc["bigbrain"]
    slots = (
        f"with {value_range([per_batch(v) / per_batch('bigbrain') * 100 for v in vs], '.0f')}% of "
        "BIG BRAIN's token slots per batch they take "
        f"{value_range(S.loc[vs, 'metrics.batch_s_median'] / bb['metrics.batch_s_median'] * 100, '.0f')}% "
        "of its median batch time"
    )
    forwards = (
        f"summed forwards {value_range(S.loc[vs, 'metrics.compute_s'], '.1f')} s against "
        f"{bb['metrics.compute_s']:.1f} s"
    )
    beyond = (
        f"epoch time beyond the forwards {value_range(outside[vs], '.1f')} s against "
        f"{outside['bigbrain']:.1f} s"
    )
    if (S.loc[vs, "metrics.compute_s"] < bb["metrics.compute_s"]).all():
        why = (
            f"k = {', '.join(map(str, slower))}: not their forwards ({slots}; {forwards}) but the "
            f"time outside them ({beyond}): host-side time (waiting for the DataLoader, moving "
            "each batch and queuing its forward), which no profile splits further"
        )
    else:
        why = f"k = {', '.join(map(str, slower))}: {slots}; {forwards}; {beyond}"
else:
    why = ultra_minimum() if ultra_k else measured(None)
tr = (
    train_all.sort_values("env.time").groupby("variant").tail(1).set_index("variant")
    if train_all is not None
    else None
)
mem_known = tr is not None and tr["metrics.peak_mem_gib"].notna().all()
ultra_range = (
    f"median batch {value_range(S.loc[[f'ultra_k{k}' for k in ultra_k], 'metrics.batch_s_median'] * 1e3, '.2f')} ms, "
    f"epoch {value_range(S.loc[[f'ultra_k{k}' for k in ultra_k], 'metrics.epoch_s'], '.1f')} s, padding "
    f"{value_range(S.loc[[f'ultra_k{k}' for k in ultra_k], 'metrics.padding_fraction'] * 100, '.1f')}% over k = "
    + ", ".join(map(str, ultra_k))
    if ultra_k
    else measured(None)
)
costs_last = (
    costs_all.sort_values("env.time").groupby(["config.n", "config.k"]).tail(1)
    if costs_all is not None
    else None
)
big_init = (
    costs_last.loc[costs_last["config.n"] >= 1_800_000, "metrics.init_s"].max()
    if costs_last is not None
    else None
)

# The sampler's per-batch cost over n (our target: within 2x over n = 10,000..1,000,000 at every
# k), and at which k and n it is largest.
BATCH_COST = None
if costs_last is not None:
    cost_span = costs_last[costs_last["config.n"].between(10_000, 1_000_000)]
    if cost_span["config.n"].nunique() >= 2:
        spread_k = cost_span.groupby("config.k")["metrics.batch_s_mean"].agg(
            lambda s: s.max() / s.min()
        )
        BATCH_COST = {
            "lo": int(cost_span["config.n"].min()),
            "hi": int(cost_span["config.n"].max()),
            "worst_k": int(spread_k.idxmax()),
            "worst": float(spread_k.max()),
        }


def sampler_answer():
    # __init__ on the largest n, and the per-batch cost over every n and k; a point more than twice
    # the others' median is named with its batch size.
    text = f"__init__ {measured(big_init, '.3f', ' s')} on 1.8M lengths"
    if costs_last is None or not len(costs_last):
        return text + f"; per-batch cost {NOT_MEASURED}"
    us = costs_last["metrics.batch_s_mean"] * 1e6
    slow = costs_last.loc[us.idxmax()]
    rest = us.drop(us.idxmax())
    if len(rest) and us.max() > 2 * rest.median():
        return text + (
            f"; per batch {rest.min():.0f}-{rest.max():.0f} us over every other n and k, but "
            f"{us.max():.0f} us at n = {int(slow['config.n']):,}, k = {int(slow['config.k'])} "
            f"(batches of {slow['metrics.mean_batch_len']:.0f} lines on average)"
        )
    return text + f"; per batch {us.min():.0f}-{us.max():.0f} us over every n and k"


def packed_answer():
    # Packed rows (BFD) against the ideal: the median of the repeated epochs the targets judge.
    h = HR_MAIN[HR_MAIN["variant"] == "packed_bfd"]
    if h.empty:
        return measured(None)
    r = h.iloc[0]
    return (
        f"compute {r['compute / ideal median']:.2f}x, epoch {r['epoch / ideal median']:.2f}x the "
        f"ideal (BFD; median of {int(r['epochs'])} epochs on {MAIN_GPU})"
    )


answers = [
    Answer(
        "BRAIN (pad to 640)",
        batch_stats("brain"),
        "Mock epoch: batch times per pipeline and k (seed 000)",
    ),
    Answer(
        "BIG BRAIN (collate_fn)",
        batch_stats("bigbrain"),
        "Mock epoch: batch times per pipeline and k (seed 000)",
    ),
    Answer(
        "ULTRA DUPER BIG BRAIN, k = 1..50",
        ultra_range,
        "Mock epoch: batch times per pipeline and k (seed 000)",
    ),
    Answer(
        "k = 640 equals BIG BRAIN",
        f"epoch {val('ultra_k640', 'metrics.epoch_s', '.2f', ' s')} vs {val('bigbrain', 'metrics.epoch_s', '.2f', ' s')}, padding "
        f"{val('ultra_k640', 'metrics.padding_fraction', '.2%')} vs {val('bigbrain', 'metrics.padding_fraction', '.2%')}",
        "BIG BRAIN against BRAIN, and k = 640",
    ),
    Answer(
        "ULTRA k = 1..50 slower than BIG BRAIN?",
        why,
        "ULTRA: 64 lines per batch against a token budget",
    ),
    Answer(
        "Sampler: __init__ O(n), __iter__ O(batch)",
        sampler_answer(),
        "Data-side cost of the bucketed sampler",
    ),
    Answer(
        "Whole training time per data set (seed 001)",
        ", ".join(f"{v} {r['metrics.total_s']:.1f} s" for v, r in tr.iterrows())
        if tr is not None
        else measured(None),
        "Training time and memory per pipeline (seed 001)",
    ),
    Answer(
        "Memory per data set (seed 001)",
        "median step peak "
        + ", ".join(f"{v} {r['metrics.step_peak_gib_median']:.2f} GiB" for v, r in tr.iterrows())
        if mem_known
        else measured(None),
        "Training time and memory per pipeline (seed 001)",
    ),
    Answer(
        "SequencedDataset (packed rows), mock epoch",
        packed_answer(),
        "Against the ideal: token-budget ULTRA and packed rows, repeated",
    ),
]
pk_last = (
    packing_all[packing_all["config.algorithm"] == "bfd"]
    .sort_values("env.time")
    .groupby("config.n")
    .tail(1)
    if packing_all is not None
    else None
)
big_pk = pk_last[pk_last["config.n"] >= 1_800_000] if pk_last is not None else None
targets = []
for v in BUDGET_VARIANTS:
    h = HR_MAIN[HR_MAIN["variant"] == v]
    m = h["epoch / ideal median"].iloc[0] if len(h) else None
    targets.append(
        Target(
            f"{v}: mock epoch within 15% of the ideal",
            None
            if m is None
            else f"{m:.3f}x ({int(h['epochs within 15%'].iloc[0])} of {int(h['epochs'].iloc[0])} epochs within)",
            None if m is None else bool(m <= TARGET_RATIO),
        )
    )
targets.append(
    Target(
        "sampler __init__ on 1.8M lengths < 1 s",
        None if big_init is None or pd.isna(big_init) else f"{big_init:.3f} s",
        None if big_init is None or pd.isna(big_init) else bool(big_init < 1),
    )
)
targets.append(
    Target(
        "sampler per-batch cost within 2x over n = 10,000..1,000,000 (every k)",
        None
        if BATCH_COST is None
        else f"{BATCH_COST['worst']:.2f}x at k = {BATCH_COST['worst_k']} "
        f"(n = {BATCH_COST['lo']:,}..{BATCH_COST['hi']:,})",
        None if BATCH_COST is None else bool(BATCH_COST["worst"] <= 2),
    )
)
if big_pk is not None and len(big_pk):
    r = big_pk.iloc[0]
    targets.append(
        Target(
            "BFD on 1.8M sequences < 10 s, fill >= 99%",
            f"{r['metrics.time_s_median']:.2f} s, fill {r['metrics.fill_ratio']:.4%}",
            bool(r["metrics.time_s_median"] < 10 and r["metrics.fill_ratio"] >= 0.99),
        )
    )
else:
    targets.append(Target("BFD on 1.8M sequences < 10 s, fill >= 99%", None, None))
TARGETS_SOURCE = f"epoch targets: the repeated epochs on {MAIN_GPU or NOT_MEASURED}"


# Appendix: where each log the report reads was made.
def provenance_table():
    """One row per log under task2/ (probes included): git sha, GPU model, GPU tag(s), runs
    (distinct run ids)."""
    paths = sorted(RESULTS.rglob("*.jsonl*"))
    logs = {str(p.relative_to(RESULTS)): [r.get("env", {}) for r in read_records(p)] for p in paths}
    return log_provenance(logs).set_index("log")
