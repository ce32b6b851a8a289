"""Loads the GPT-2 logs (results/gpt2/, results/gpt2_pretrained/) for memory_efficient_gpt2.ipynb.

Builds what the report's sections read: the GPT-2-Large runs of train.py (steps, memory budgets,
the speed baselines timed in the main run's process), the fixed-batch equivalence against torch
AdamW from random and from pretrained weights, ours beside torchao's CPUOffloadOptimizer, the
GPT-2-XL level runs (one host per GPU kind) with their baselines, the fine-tune on code where its
log is present, and the answers and targets of the report's first two tables. It displays
nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import contextlib
import math

import pandas as pd
from loaders.replicates import (
    is_replicate,
    log_provenance,
    run_key,
)  # reports/loaders/ (cwd: reports/)

from effdl.answers import Answer, Target
from effdl.results import device_name, find_log, load_results, on_gpu, read_records, results_dir
from effdl.tables import MISSING
from effdl.tables import measured as value_or_missing

GIB = 1024**3
df = load_results(results_dir("results") / "gpt2")
# the optimizer-equivalence probe and the fine-tune on code have their own record layouts: their
# sections read them
df = df[
    ~df["source"].str.startswith(
        ("optimizer_equivalence", "gpt2_finetune_code", "gpt2_xl_pretrain_docs")
    )
    & ~df["source"].map(is_replicate)
]  # replicate logs: the appendix sets them beside their main log
# run logs store non-finite floats as strings ("nan": e.g. GPU memory on a CPU run)
for col in df.columns:
    if col.startswith(("metrics.", "config.")) and col != "metrics.timeline":
        with contextlib.suppress(ValueError, TypeError):  # non-numeric columns stay as they are
            df[col] = pd.to_numeric(df[col].replace({"nan": math.nan, "inf": math.inf}))
# Prefer GPU runs: CPU smoke runs in the same folder would otherwise mix into the GPU numbers.
CPU_RECORDS_DROPPED = 0  # records of CPU runs left out (the report says how many)
if df["env.gpu"].notna().any():
    CPU_RECORDS_DROPPED = int(df["env.gpu"].isna().sum())
    df = df[df["env.gpu"].notna()].copy()
gpt2_all = df  # every GPU record of the folder (the GPT-2-XL section reads it)
# the GPT-2-Large sections (quick demo logs hold only the tiny model: they show that one)
MAIN_SIZE = "large" if (df["config.size"] == "large").any() else df["config.size"].dropna().iloc[0]
df = df[df["config.size"] == MAIN_SIZE].copy()
# run identity = (log file, learning rate, start time); baseline records have no lr
lr_text = df["config.lr"].map(lambda v: "-" if pd.isna(v) else f"{v:g}")
df["run"] = df["source"] + " | lr " + lr_text + " | " + df["env.time"]
STEP_VARIANTS = ["corpus", "fixed_batch"]
steps = df[df.variant.isin(STEP_VARIANTS)].sort_values(["run", "metrics.step"])
machine = device_name(df.iloc[0])


def data_kind(name):
    """'real' for the stdlib text (train.py's default), 'generated' for the synthetic stream."""
    return "generated" if name == "synthetic" else "real"


def latest_run(variant, grad_accumulation, sources=None):
    """Run id of the latest `variant` run with this gradient-accumulation mode (in one of the
    log files `sources` when given), or None."""
    r = steps[(steps.variant == variant) & (steps["config.grad_accumulation"] == grad_accumulation)]
    if sources is not None:
        r = r[r.source.isin(sources)]
    return r.sort_values("env.time")["run"].iloc[-1] if len(r) else None


def run_steps(run):
    return steps[steps.run == run]


def record(variant, run):
    """The single `variant` record (memory_budget, *_summary) of one run."""
    r = df[(df.variant == variant) & (df.run == run)]
    assert len(r) == 1, f"{len(r)} {variant} records for run {run}"
    return r.iloc[0]


def run_speed(run):
    s = run_steps(run)
    steady = s[s["metrics.step"] > 0] if len(s) > 1 else s  # step 0 pays warm-up
    return {
        "measured peak GiB": s["metrics.peak_gib"].max(),
        "seq/s (median)": steady["metrics.seq_per_s"].median(),
        "d2h s (median)": steady["metrics.d2h_s"].median(),
        "cpu accumulate s (median)": steady["metrics.cpu_accumulate_s"].median(),
        "step wait s (median)": steady["metrics.step_wait_s"].median(),
    }


def loss_stats(run):
    s = run_steps(run)["metrics.loss"].to_numpy()
    return {
        "steps": len(s),
        "loss first": s[0],
        "loss last": s[-1],
        "loss min": s.min(),
        "mean of last 5": s[-5:].mean(),
        "drop (last)": 1 - s[-1] / s[0],
        "drop (min)": 1 - s.min() / s[0],
    }


# The main run: the latest corpus run whose log also holds the two speed baselines (same process).
main_run = latest_run("corpus", "gpu", sources=set(df.loc[df.variant == "baseline_own", "source"]))
cpu_run = latest_run("corpus", "cpu")

main_source = run_steps(main_run)["source"].iloc[0]
same_run = df[df.source == main_source]  # baselines measured in the main run's process and host


def best_baseline(variant):
    """The fastest micro-batch of a baseline logged beside the main run; checked against the
    script's own pick (`<variant>_best`)."""
    rows = same_run[same_run.variant == variant]
    best = rows.loc[rows["metrics.seq_per_s"].idxmax()]
    picked = same_run[same_run.variant == f"{variant}_best"]
    assert int(picked["metrics.micro_batch"].iloc[0]) == int(best["config.micro_batch"])
    return rows, best


def large_command(run):
    """The train.py command line of one offloaded run, rebuilt from its config."""
    c = run_steps(run).iloc[0]
    flags = ["--fixed-batch"] if c["variant"] == "fixed_batch" else []
    flags.append(f"--steps {len(run_steps(run))}")
    if c["config.data"] == "synthetic":
        flags.append("--data generated")
    if c.get("config.moments") == "int8":  # level 3's optimizer on this model
        flags.append(f"--level 3 --size {c['config.size']}")
    elif c["config.grad_accumulation"] == "cpu":
        flags.append("--grad-accumulation cpu")
    warmup = c.get("config.warmup_steps")
    flags.append(f"--lr {c['config.lr']:g} --warmup-steps {0 if pd.isna(warmup) else int(warmup)}")
    if isinstance(c.get("config.lr_schedule"), str):
        flags.append(f"--lr-schedule {c['config.lr_schedule']}")
    if (df[df.source == c["source"]].variant == "reference_adamw").any():
        flags.append("--reference adamw")
    # a CPU run is the --quick smoke run (its tiny model has no flag of its own)
    device = "--device cuda" if on_gpu(c) else "--quick"
    return f"python3 memory_efficient_gpt2/train.py {device} {' '.join(flags)} --out runs/gpt2"


inventory = steps.groupby("run", sort=False).agg(
    variant=("variant", "first"),
    data=("config.data", lambda v: data_kind(v.iloc[0])),
    grad_accumulation=("config.grad_accumulation", "first"),
    lr=("config.lr", "first"),
    checkpoint_layers=("config.checkpoint_layers", "first"),
    steps=("metrics.step", "size"),
)


# GPT-2-XL: every level run (one host per GPU kind) and the baselines timed in the same log.
XL_CAPS = {1: (16.0, None), 2: (16.0, None), 3: (11.0, 16.0)}  # the seed's GPU and host GiB caps
XL_OURS = {1: 0.9, 3: 0.7}  # our speed targets, x Hugging Face's forward+backward
xl = gpt2_all[gpt2_all["config.size"] == "xl"]
levels = gpt2_all[gpt2_all.variant == "corpus_summary"]
levels = levels[levels.get("config.level", pd.Series(index=levels.index, dtype=float)).notna()]


def gpu_kind(rec):
    """'H100', 'H200': the GPU's model, the way the report names a host's kind."""
    return str(rec["env.gpu"]).removeprefix("NVIDIA ").split()[0]


levels = levels.assign(kind=[gpu_kind(r) for _, r in levels.iterrows()])
# one host per GPU kind: the one with the most level runs (the latest on a tie)
XL_HOST = {
    kind: g.groupby("env.gpu_id")["env.time"]
    .agg(["size", "max"])
    .sort_values(["size", "max"])
    .index[-1]
    for kind, g in levels.groupby("kind")
}
levels = levels[levels["env.gpu_id"].isin(XL_HOST.values())]
XL_KINDS = sorted(XL_HOST, key=lambda k: -levels[levels.kind == k]["config.level"].nunique())


def xl_level(level, kind=None):
    """The latest corpus_summary record of a `--level` run (on this GPU kind; by default the kind
    with the most levels), or None."""
    kind = kind or (XL_KINDS[0] if XL_KINDS else None)
    s = levels[(levels["config.level"] == level) & (levels.kind == kind)].sort_values("env.time")
    return s.iloc[-1] if len(s) else None


def xl_best(rec, variant):
    """A baseline's best micro-batch in the level run's own log (same host, same commit)."""
    b = xl[
        (xl.variant == variant)
        & (xl.source == rec["source"])
        & (xl["env.gpu_id"] == rec["env.gpu_id"])
    ]
    return b.loc[b["metrics.seq_per_s"].idxmax()] if len(b) else None


def xl_check(level, s):
    """One level's numbers: peaks against the seed's caps, speed against both baselines."""
    gpu_cap, host_cap = XL_CAPS[level]
    hf, own = xl_best(s, "baseline"), xl_best(s, "baseline_own")
    speed = s["metrics.seq_per_s_median"]
    return {
        "GPU": s["kind"], "run": f"--level {int(s['config.level'])}",
        "data": f"{s['config.data']} ({'generated' if s['config.data'] == 'synthetic' else 'real'})",
        "moments, update on": f"{s['config.moments']}, updated on the {s['config.update_on']}",
        "peak GPU GiB": s["metrics.peak_gib_max"], "GPU cap GiB": gpu_cap,
        "host RSS peak GiB": s["metrics.host_rss_peak_gib"],
        "host cap GiB": host_cap if host_cap is not None else "none",
        "seq/s (median)": speed,
        "HF baseline seq/s (best micro-batch)": hf["metrics.seq_per_s"] if hf is not None else math.nan,
        "ratio to HF": speed / hf["metrics.seq_per_s"] if hf is not None else math.nan,
        "ratio to our fwd+bwd": speed / own["metrics.seq_per_s"] if own is not None else math.nan,
        "caps met": bool(s["metrics.peak_gib_max"] <= gpu_cap
                         and (host_cap is None or s["metrics.host_rss_peak_gib"] <= host_cap)),
    }  # fmt: skip


xl_rows = {}
for kind in XL_KINDS:
    for level in (1, 2, 3):
        s = xl_level(level, kind)
        if s is not None:
            xl_rows[f"{kind} level {level}"] = xl_check(level, s)
xl_table = pd.DataFrame(xl_rows).T


# GPT-2-Large on real text: ours against torch AdamW on one fixed batch; ours beside torchao.
def latest(variant, moments=None):
    """The latest record of `variant` in the folder (of a run with these Adam `moments` when
    given), or None."""
    r = gpt2_all[gpt2_all.variant == variant]
    if moments is not None:
        r = r[r["config.moments"] == moments]
    r = r.sort_values("env.time")
    return r.iloc[-1] if len(r) else None


def steps_of(variant, rec):
    """The per-step records of the run that wrote the summary-like record `rec`."""
    r = gpt2_all[(gpt2_all.variant == variant) & (gpt2_all.source == rec["source"])
                 & (gpt2_all["env.time"] == rec["env.time"])]  # fmt: skip
    return r.sort_values("metrics.step")


equiv = latest("equivalence", moments="fp32")
equiv3 = latest("equivalence", moments="int8")
if equiv is not None:
    eq_ours = pd.Series(equiv["metrics.loss_ours"])
    eq_ref = pd.Series(equiv["metrics.loss_reference"])
    fall_total = eq_ours.iloc[0] - eq_ours.iloc[-1]
    # the first step from which at most 5% of the run's whole fall is still to come
    flat_from = int((eq_ours - eq_ours.iloc[-1] <= 0.05 * fall_total).idxmax())
    equiv_ok = {
        "gap": equiv["metrics.mean_abs_gap"] <= equiv["metrics.max_mean_gap_nats"],
        "fall": min(equiv["metrics.fall_ours"], equiv["metrics.fall_reference"])
        >= equiv["metrics.min_fall"],
    }

peer = latest("torchao_summary")
if peer is not None:
    # ours: the offloaded corpus run in the same log, on the same host, right before torchao's
    ours_peer = gpt2_all[(gpt2_all.variant == "corpus_summary") & (gpt2_all.source == peer["source"])
                         & (gpt2_all["config.size"] == peer["config.size"])].iloc[-1]  # fmt: skip
    assert ours_peer["env.gpu_id"] == peer["env.gpu_id"], "ours and torchao on different hosts"
    peer_loss = pd.DataFrame({
        "ours": steps_of("corpus", ours_peer)["metrics.loss"].to_numpy(),
        "torchao": steps_of("torchao", peer)["metrics.loss"].to_numpy(),
    })  # fmt: skip
    peer_ratio = ours_peer["metrics.seq_per_s_median"] / peer["metrics.seq_per_s_median"]

# GPT-2-Large pretrained here (pretrain.py), then the fixed-batch test from its weights.
pre_dir = results_dir("results") / "gpt2_pretrained"
pre_recs = (
    [r for f in sorted(pre_dir.glob("*.jsonl*")) for r in read_records(f)]
    if pre_dir.exists()
    else []
)
pretrainings = [r for r in pre_recs if r["variant"] == "pretrain_summary"]
pre_equivs = sorted((r for r in pre_recs if r["variant"] == "equivalence"),
                    key=lambda r: (r["config"]["batch"], r["config"]["lr"]))  # fmt: skip


def pretraining_of(rec):
    """The pretraining whose saved weights `rec`'s run started from: the latest one before it on
    the same host (each pair ran back to back on one machine)."""
    before = [p for p in pretrainings
              if p["env"]["gpu_id"] == rec["env"]["gpu_id"] and p["env"]["time"] < rec["env"]["time"]]  # fmt: skip
    return max(before, key=lambda p: p["env"]["time"]) if before else None


def records_of_run(rec, variant):
    """The records of `variant` written by the run that wrote `rec`."""
    return [
        r for r in pre_recs if r["variant"] == variant and run_key(r["env"]) == run_key(rec["env"])
    ]


pre_rows = []
for eq in pre_equivs:
    pt, m, c = pretraining_of(eq), eq["metrics"], eq["config"]
    ours_sum = records_of_run(eq, "fixed_batch_summary")[0]["metrics"]
    passed = bool(m["mean_abs_gap"] <= m["max_mean_gap_nats"]
                  and min(m["fall_ours"], m["fall_reference"]) >= m["min_fall"])  # fmt: skip
    pre_rows.append({
        "batch (seq x 1024)": int(c["batch"]), "lr": c["lr"], "warm-up": int(c["warmup_steps"]),
        "pretraining steps": pt["metrics"]["steps"] if pt else None,
        "passes over corpus": pt["metrics"]["passes"] if pt else None,
        "held-out 64-seq loss after pretraining": pt["metrics"]["heldout_loss"] if pt else None,
        "loss first": m["loss_ours"][0], "loss last (ours)": m["loss_ours"][-1],
        "fall ours": m["fall_ours"], "fall AdamW": m["fall_reference"],
        "mean |gap|": m["mean_abs_gap"], "max |gap|": m["max_abs_gap"],
        "ours peak GPU GiB": ours_sum["peak_gib_max"], "cap GiB": c["memory_cap_gib"],
        "both targets": "MET" if passed else "NOT MET",
    })  # fmt: skip
pre_table = pd.DataFrame(pre_rows)
pre_pass = pre_table[pre_table["both targets"] == "MET"] if len(pre_table) else pre_table


# The fine-tunes of GPT-2-XL on code (finetune_code.py), one log per run, and the documentation
# pretraining (pretrain.py --corpus docs) their starting weights come from, where the logs exist.
def summary_of(records, variant):
    return next((r for r in records if r["variant"] == variant), None)


GPT2_DIR = results_dir("results") / "gpt2"
ft_logs = {p: read_records(p) for p in sorted(GPT2_DIR.glob("gpt2_finetune_code*.jsonl*"))}
ft_logs = {p: recs for p, recs in ft_logs.items() if summary_of(recs, "finetune_summary")}
ft_runs = pd.DataFrame([
    {"log": p.name, "steps": s["metrics"]["steps"], "passes": s["metrics"]["passes"],
     "held-out loss before": s["metrics"]["heldout_loss_before"],
     "held-out loss after": s["metrics"]["heldout_loss_after"],
     "seq/s (median)": s["metrics"]["seq_per_s_median"],
     "peak GPU GiB": s["metrics"]["peak_gib_max"], "GPU cap GiB": s["config"]["memory_cap_gib"],
     "host RSS peak GiB (sampled)": s["metrics"]["host_rss_peak_gib"],
     "host RSS high-water GiB": s["metrics"]["host_rss_high_water_gib"],
     "host cap GiB": s["config"]["host_memory_cap_gib"],
     "GPU": device_name(s["env"])}
    for p, recs in ft_logs.items() for s in [summary_of(recs, "finetune_summary")]
])  # fmt: skip
# the generations shown side by side: the longest fine-tune's
ft_path = max(ft_logs, key=lambda p: summary_of(ft_logs[p], "finetune_summary")["metrics"]["steps"],
              default=GPT2_DIR / "gpt2_finetune_code.jsonl")  # fmt: skip
ft = ft_logs.get(ft_path, [])
ft_summary = summary_of(ft, "finetune_summary")
ft_gens = pd.DataFrame([{"prompt": r["metrics"]["prompt"], "kind": r["config"]["kind"],
                         "mode": r["metrics"]["mode"], "phase": r["variant"],
                         "prompt text": r["metrics"]["prompt_text"], "text": r["metrics"]["completion"]}
                        for r in ft if r["variant"] in ("before", "after")])  # fmt: skip


def blank_greedy(phase):
    """(greedy continuations of `phase` that are whitespace only, all greedy ones of `phase`)."""
    g = ft_gens[(ft_gens.phase == phase) & (ft_gens["mode"] == "greedy")]
    return int(g.text.str.strip().eq("").sum()), len(g)


ft_blank = {phase: blank_greedy(phase) for phase in ("before", "after")} if len(ft_gens) else {}
docs_logs = sorted(GPT2_DIR.glob("gpt2_xl_pretrain_docs*.jsonl*"))
docs_pretrain = summary_of(read_records(docs_logs[0]), "pretrain_summary") if docs_logs else None

# The numbers the answers and our targets read.
cap = steps["config.memory_cap_gib"].max()
peaks = steps["metrics.peak_gib"]
r = r_own = math.nan
if main_run is not None and {"baseline", "baseline_own"} <= set(same_run.variant):
    ours_speed = run_speed(main_run)["seq/s (median)"]
    r = ours_speed / best_baseline("baseline")[1]["metrics.seq_per_s"]
    r_own = ours_speed / best_baseline("baseline_own")[1]["metrics.seq_per_s"]
budget = record("memory_budget", main_run)
gen_runs = steps[(steps.variant == "fixed_batch") & (steps["config.data"] == "synthetic")]
gen_falls = pd.Series(
    {run: loss_stats(run)["drop (last)"] for run in gen_runs.run.unique()}, dtype=float
)


def per_kind(level, text):
    """'H200: ...; H100: ...' over the GPU kinds with a run of this level, or not measured."""
    parts = [f"{kind}: {text(xl_rows[f'{kind} level {level}'])}" for kind in XL_KINDS
             if f"{kind} level {level}" in xl_rows]  # fmt: skip
    return "; ".join(parts) or MISSING


def level2_speed(row):
    s = xl_level(2, row["GPU"])
    sr = xl[
        (xl.variant == "speed_ratio")
        & (xl.source == s["source"])
        & (xl["env.time"] == s["env.time"])
    ]
    hf, own = ((sr.iloc[0][f"metrics.ratio_to_baseline{k}"] for k in ("", "_own")) if len(sr)
               else (row["ratio to HF"], row["ratio to our fwd+bwd"]))  # fmt: skip
    return f"{speed_against(hf, own)}; peak {row['peak GPU GiB']:.2f} GiB"


def speed_against(hf, own, judge=True):
    """A speed answer that names both baselines it divides by (each at its fastest micro-batch,
    no cap, same process), and whether each ratio clears the seed's 0.5x (only when `judge`: the
    seed's bar is for a GPU, not for a CPU demo run)."""

    def one(ratio, baseline):
        verdict = "" if pd.isna(ratio) or not judge else f", {'≥' if ratio >= 0.5 else '<'} 0.5x"
        return f"{value_or_missing(ratio, '.2f', 'x')} {baseline}{verdict}"

    return (f"{one(hf, 'Hugging Face GPT2LMHeadModel fwd+bwd (fp32 weights, fp16 autocast)')}; "
            f"{one(own, 'our GPT-2 fwd+bwd (bf16 weights, chunked loss)')}")  # fmt: skip


def finetune_answer():
    if ft_summary is None:
        return MISSING
    m = ft_summary["metrics"]
    (b, n), (a, _) = ft_blank["before"], ft_blank["after"]
    return (f"held-out code loss {m['heldout_loss_before']:.2f} → {m['heldout_loss_after']:.2f} nats/token "
            f"after {m['steps']} steps; greedy continuations that are whitespace only: {b} of {n} "
            f"before, {a} of {n} after ({device_name(ft_summary['env'])})")  # fmt: skip


host_masters = budget.get("metrics.host_master_weights_gib")
main_on_gpu = on_gpu(run_steps(main_run).iloc[0])
n_params = int(budget["config.n_params"])
answers = [
    Answer("GPT-2-Large: peak GPU memory ≤ 11 GiB",
           f"max {peaks.max():.2f} GiB over {int(peaks.notna().sum())} steps of {steps.run.nunique()} runs"
           if peaks.notna().any() else MISSING, "Peak GPU memory at every step"),
    Answer("Speed ≥ 0.5x plain forward/backward",
           f"{speed_against(r, r_own, judge=main_on_gpu)} ({gpu_kind(run_steps(main_run).iloc[0]) if main_on_gpu else 'CPU'})",
           "Speed against plain forward/backward"),
    Answer("Adam; loss falls on a fixed batch, as plain training",
           f"fall {equiv['metrics.fall_ours']:.1%} in {int(equiv['metrics.steps'])} steps; mean |gap| to torch "
           f"AdamW {equiv['metrics.mean_abs_gap']:.4f} nats" if equiv is not None else MISSING,
           "Fixed real batch: our offloaded Adam against torch AdamW"),
    Answer("fp32 master weights",
           f"fp32 masters {host_masters:.2f} GiB + two fp32 Adam moments in host memory; bf16 working "
           "copy on the GPU" if not pd.isna(host_masters) else MISSING, "Memory budget: what lives where"),
    Answer("Every parameter updated every step",
           f"all {n_params:,} parameters in the offloaded Adam, one update per "
           f"{int(budget['config.batch'])}-sequence step",
           "Memory budget: what lives where"),
    Answer("GPT-2-XL level 1: 16 GiB GPU",
           per_kind(1, lambda x: f"peak {x['peak GPU GiB']:.2f} GiB"), "GPT-2-XL: levels 1, 2 and 3"),
    Answer("GPT-2-XL level 2: ≥ 0.5x fwd/bwd", per_kind(2, level2_speed), "GPT-2-XL: levels 1, 2 and 3"),
    Answer("GPT-2-XL level 3: 11 GiB GPU, 16 GiB host",
           per_kind(3, lambda x: f"peak {x['peak GPU GiB']:.2f} GiB GPU, {x['host RSS peak GiB']:.2f} GiB host"),
           "GPT-2-XL: levels 1, 2 and 3"),
    Answer("GPT-2-XL bonus: fine-tune on code, compare outputs", finetune_answer(),
           "GPT-2-XL fine-tuned on code: generations before and after"),
]  # fmt: skip


# The project's own targets (the report's second table)
targets = []
if equiv is not None:
    targets += [
        Target(f"fixed real batch, random weights: mean |gap| to torch AdamW ≤ {equiv['metrics.max_mean_gap_nats']:g} nats",
               f"{equiv['metrics.mean_abs_gap']:.4f} nats", bool(equiv_ok["gap"])),
        Target(f"fixed real batch, random weights: loss of both falls ≥ {equiv['metrics.min_fall']:.0%} in "
               f"{int(equiv['metrics.steps'])} steps",
               f"ours {equiv['metrics.fall_ours']:.1%}, AdamW {equiv['metrics.fall_reference']:.1%}", bool(equiv_ok["fall"])),
    ]  # fmt: skip
if len(pre_table):
    targets.append(Target(
        "fixed real batch from pretrained weights: both of the above, in every run",
        f"{len(pre_pass)} of {len(pre_table)} runs: "
        + ", ".join(f"batch {b}, lr {lr:g}: {v.lower()}" for b, lr, v in zip(pre_table["batch (seq x 1024)"], pre_table["lr"], pre_table["both targets"], strict=True)),
        bool(len(pre_pass) == len(pre_table)),
    ))  # fmt: skip
if peer is not None:
    targets.append(Target("torchao's CPUOffloadOptimizer measured on the same host as ours",
                          f"ours {peer_ratio:.2f}x torchao's speed",
                          bool(ours_peer["env.gpu_id"] == peer["env.gpu_id"])))  # fmt: skip
for level, need in XL_OURS.items():
    rows = [x for x in xl_rows.values() if x["run"] == f"--level {level}"]
    targets.append(Target(
        f"GPT-2-XL level {level}: ≥ {need}x HF fwd+bwd inside the caps",
        "; ".join(f"{x['GPU']}: {x['ratio to HF']:.2f}x" for x in rows) or None,
        all(x["ratio to HF"] >= need and x["caps met"] for x in rows) if rows else None,
    ))  # fmt: skip
if len(gen_falls):
    targets.append(Target("generated fixed batch: loss falls ≥ 50% in 30 steps",
                          f"{gen_falls.min():.1%} to {gen_falls.max():.1%}", bool((gen_falls >= 0.5).all())))  # fmt: skip
CAP_FIELDS = ["peak GPU GiB", "GPU cap GiB", "host RSS high-water GiB", "host cap GiB"]
for _, row in (ft_runs.dropna(subset=CAP_FIELDS) if len(ft_runs) else ft_runs).iterrows():
    targets.append(Target(
        f"fine-tune on code, {row['steps']} steps at level 3: GPU ≤ {row['GPU cap GiB']:g} GiB and the "
        f"process's host high-water mark ≤ {row['host cap GiB']:g} GiB",
        f"peak GPU {row['peak GPU GiB']:.2f} GiB, host high-water {row['host RSS high-water GiB']:.2f} GiB",
        bool(row["peak GPU GiB"] <= row["GPU cap GiB"]
             and row["host RSS high-water GiB"] <= row["host cap GiB"]),
    ))  # fmt: skip


def provenance_table(folders):
    """One row per log the report reads: its commit, GPU model, GPU tags (env.gpu_id) and runs."""
    logs = {
        f"{folder.name}/{path.name}": [r["env"] for r in read_records(path)]
        for folder in folders
        for path in sorted(folder.glob("*.jsonl*"))
    }
    return log_provenance(logs).set_index("log")


provenance = provenance_table([d for d in (GPT2_DIR, pre_dir) if d.exists()])


def speed_ratios(records):
    """A log's speed against the two forward+backward baselines of its own process: (Hugging
    Face's, ours), each at its fastest micro-batch; the script's own ``speed_ratio`` record where
    the log holds one (GPT-2-XL levels), else the offloaded run's median steady step (step 0 pays
    warm-up) over the baselines."""
    for r in records:
        if r["variant"] == "speed_ratio":
            return r["metrics"]["ratio_to_baseline"], r["metrics"]["ratio_to_baseline_own"]
    best = {v: max((r["metrics"]["seq_per_s"] for r in records if r["variant"] == v), default=math.nan)
            for v in ("baseline", "baseline_own")}  # fmt: skip
    speed = steady_steps(records)["seq_per_s"].median()
    return speed / best["baseline"], speed / best["baseline_own"]


def steady_steps(records):
    """The metrics of a log's offloaded steps after the first (step 0 pays warm-up), one row each."""
    return pd.DataFrame([r["metrics"] for r in records
                         if r["variant"] == "corpus" and r["metrics"]["step"] > 0])  # fmt: skip


# Headline speed ratios on a second GPU: each replicate log beside the main log it reruns.
REPLICATED = {  # replicate log -> (what it measures, main log)
    "gpt2_large_speed_baselines_and_offload_replicate.jsonl": (
        "GPT-2-Large, offloaded Adam", "gpt2_large_speed_baselines_and_offload.jsonl"),
    "gpt2_xl_level2_replicate.jsonl": ("GPT-2-XL, level 2", "gpt2_xl_levels_1_2_3_h200.jsonl.gz"),
}  # fmt: skip
replicate_rows = []
for name, (what, main_name) in REPLICATED.items():
    main_path, rep_path = find_log(GPT2_DIR / main_name), find_log(GPT2_DIR / name)
    if not (main_path.exists() and rep_path.exists()):
        continue
    rep = read_records(rep_path)
    main_recs = [r for r in read_records(main_path) if r["config"].get("level") in (None, 2)]
    for label, recs in (("main", main_recs), ("replicate", rep)):
        hf, own = speed_ratios(recs)
        env = recs[-1]["env"]
        step = steady_steps(recs)
        replicate_rows.append({"measures": what, "log": label, "GPU": device_name(env),
                               "GPU tag": env.get("gpu_id"), "git sha": str(env["git_sha"])[:7],
                               "CPU cores seen": env.get("cpu_count"),
                               "step s": step["step_s"].median(),
                               "GPU part s": step["gpu_compute_s"].median(),
                               "CPU update s": step["cpu_update_s"].median(),
                               "x HF fwd+bwd": hf, "x our fwd+bwd": own})  # fmt: skip
REPLICATE_COLUMNS = ["measures", "log", "GPU", "GPU tag", "git sha", "CPU cores seen", "step s",
                     "GPU part s", "CPU update s", "x HF fwd+bwd", "x our fwd+bwd"]  # fmt: skip
speed_replicates = pd.DataFrame(replicate_rows, columns=REPLICATE_COLUMNS)
