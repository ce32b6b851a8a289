"""Loads the SwiGLU checkpointing logs (results/swiglu/) for swiglu_checkpoint.ipynb.

Builds what the report's sections read: the benchmark records of one GPU kind and its newest
commit (the main grid of five variants in fp32 and bf16, with the GEMMs per layer counted on the
CPU by the benchmark's own function; its stack, bare or residual, read from ``config.residual``:
``MAIN_RESIDUAL``), the ratios between variants with their bootstrap intervals (``r``), the
records of the other stack where the log has both (``other``, ``stack_cmp``), the assignment's
grid of five shapes at checkpoint levels 0 and 1 (``seed``, ``seed_pairs``, ``seed_ratio``), the
GEMM-count and small-configuration probes, and the rows of the answers table (``answers``). It displays nothing: the notebook runs it with ``%run -i`` and
shows the tables.

For the last appendix, ``provenance``: one row per log with its commit, GPU, GPU tag and runs.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from loaders.replicates import (  # reports/loaders/ (cwd: reports/)
    envs_by_log,
    log_provenance,
    log_records,
)

from effdl.answers import Answer
from effdl.notebooks import REPORTS
from effdl.results import device_name, results_dir
from effdl.tables import measured


def load_script(path):
    """A task script as a module: the notebook calls the benchmark's own functions."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


benchmark = load_script(REPORTS.parent / "swiglu_checkpoint" / "benchmark.py")
CPU = torch.device("cpu")  # the correctness check and the GEMM count run here

SWIGLU = results_dir("results") / "swiglu"


def load_logs():
    """Every record of the logs under results/swiglu/ (plain or .gz); None if there are none."""
    rows = log_records(SWIGLU, ("**/*.jsonl", "**/*.jsonl.gz"))
    if not rows:
        return None
    frame = pd.DataFrame(rows)
    for col in frame.columns:  # JSON has no literal for nan: such numbers are logged as "nan"
        if col.startswith("metrics."):
            vals = frame[col].dropna()
            if vals.map(lambda v: isinstance(v, (int, float)) or v in ("nan", "inf", "-inf")).all():
                frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame


raw = load_logs()
if raw is None:
    raise FileNotFoundError(f"no run logs under {SWIGLU}")
LOG = raw["source"].map(lambda s: Path(s).name.split(".")[0])  # which script wrote the record
gemm_log = raw[LOG == "gemm_kernel_count"]
kernel_probe = raw[LOG == "small_config_kernels"]

# The benchmark's records (logs named benchmark*), on a GPU where there is one: per stack (a run's
# config.residual) the newest commit and its GPU; for each (dtype, config, stack) the newest run
# there.
bench = raw[LOG.str.startswith("benchmark")].copy()
bench["env.gpu"] = [device_name(rec) for _, rec in bench.iterrows()]  # a CPU run: "CPU (x86_64)"
on_gpu = bench[~bench["env.gpu"].str.startswith("CPU")]
pool = on_gpu if len(on_gpu) else bench


def stack_of_runs(frame):
    """config.residual of each run (env.run_id) of ``frame``, from its variant records."""
    rows = frame[frame["config.residual"].notna()]
    return rows.groupby("env.run_id")["config.residual"].first().astype(bool)


pool = pool.assign(stack=pool["env.run_id"].map(stack_of_runs(pool)))
newest_per_stack = pool.dropna(subset=["stack"]).sort_values("env.time").groupby("stack").tail(1)
runs = pd.concat(
    pool[(pool["stack"] == n["stack"]) & (pool["env.git_sha"] == n["env.git_sha"])
         & (pool["env.gpu"] == n["env.gpu"])]
    for _, n in newest_per_stack.iterrows()
)  # fmt: skip
MACHINE = " / ".join(sorted(set(runs["env.gpu"])))
ON_GPU = len(on_gpu) > 0
NOT_MEASURED = "не измерено"

VARIANTS = ["reference", "checkpoint", "level0", "level1", "level2"]
NAMES = {
    "reference": "эталон",
    "checkpoint": "torch.utils.checkpoint",
    "level0": "уровень 0",
    "level1": "уровень 1",
    "level2": "уровень 2",
}
# The assignment's grid (its run_experiments): five shapes, levels 0 and 1, float32, a bare stack.
SEED_GRID = [
    (16, 128, 512, 2048, 2),
    (32, 128, 512, 2048, 2),
    (8, 512, 1024, 4096, 3),
    (16, 512, 1024, 4096, 3),
    (4, 1024, 4096, 16384, 5),
]
SHAPE = [
    "config.batch_size",
    "config.seq_len",
    "config.hidden_dim",
    "config.intermediate_size",
    "config.num_layers",
]
KEY = ["config.dtype", *SHAPE, "residual"]


def variant_records(frame):
    """The variants' records of ``frame`` that have a step time: the shape as integers, the
    stack as ``residual``, for each (dtype, shape, stack) the newest run's records only, and the
    configuration's label ``config``."""
    f = frame[frame["variant"].isin(VARIANTS) & frame["metrics.step_s_median"].notna()].copy()
    f[SHAPE] = f[SHAPE].astype(int)
    f["residual"] = f["config.residual"].astype(bool)
    f = f[f["env.time"] == f.groupby(KEY)["env.time"].transform("max")]
    f["config"] = [f"{b}x{s} h{h} i{i} L{n}" for b, s, h, i, n in f[SHAPE].itertuples(index=False)]
    return f


m = variant_records(runs)
# FLOPs of one (N x H) @ (H x I) GEMM in every layer: 2 * batch * seq * hidden * intermediate * layers
m["gemm_unit"] = np.prod(m[SHAPE].to_numpy(dtype=float), axis=1) * 2
m["order"] = m["variant"].map(VARIANTS.index)
m = m.sort_values(["config.dtype", "residual", "gemm_unit", "order"], kind="stable")

# GEMMs per layer and training step: counted on the CPU by the benchmark's own function when the
# notebook runs; the log's own count (gemms_per_layer) is what its derived fields used.
COUNTED = {
    (v, res): benchmark.counted_gemms(v, torch.float64, CPU, res)
    for v in VARIANTS
    for res in (True, False)
}
m["gemms_counted"] = [COUNTED[v, res] for v, res in zip(m["variant"], m["residual"], strict=True)]
m["gemms"] = m["metrics.gemms_per_layer"]
for ours, col in [
    ("tflops", "metrics.tflops_executed"),
    ("of_ceiling", "metrics.frac_ceiling"),
    ("floor_s", "metrics.floor_s"),
    ("floor_frac", "metrics.floor_frac"),
]:
    m[ours] = m[col]


def stack_name(residual):
    """The stack of a record with config.residual = ``residual``."""
    return "x + MLP(x)" if residual else "MLP(x)"


def covers_seed(frame):
    """Whether ``frame`` has levels 0 and 1 in fp32 at every shape of the assignment's grid."""
    f = frame[(frame["config.dtype"] == "fp32") & frame["variant"].isin(["level0", "level1"])]
    levels = f.groupby(SHAPE)["variant"].nunique()
    return all(levels.get(shape, 0) == 2 for shape in SEED_GRID)


# The main grid: the assignment's bare stack (config.residual false) where the log has it for the
# assignment's shapes (or has no other stack), else the stack the log has; the records of the
# other stack, where there are any, are a comparison.
STACKS = set(m["residual"])
MAIN_RESIDUAL = True in STACKS and not (False in STACKS and covers_seed(m[~m["residual"]]))
main = m[m["residual"] == MAIN_RESIDUAL]
other = m[m["residual"] != MAIN_RESIDUAL]
MAIN_STACK = stack_name(MAIN_RESIDUAL)
STACK = f"стек {MAIN_STACK}"  # the captions' name of the main grid's stack
STACK_NOTE = (
    f"Основная сетка — стек {MAIN_STACK}"
    f"{' (стек задания)' if not MAIN_RESIDUAL else ''}, config.residual = {str(MAIN_RESIDUAL).lower()}: "
    f"{main.groupby(['config.dtype', 'config']).ngroups} сочетаний (dtype, конфигурация)"
    + (
        f"; стек {stack_name(not MAIN_RESIDUAL)} (config.residual = {str(not MAIN_RESIDUAL).lower()}): "
        f"{other.groupby(['config.dtype', 'config']).ngroups} сочетаний, сравнение стеков — в разделе "
        "«Два стека»."
        if len(other)
        else f"; записей стека {stack_name(not MAIN_RESIDUAL)} в журнале нет."
    )
)


def pivot(frame, col):
    return frame.pivot_table(
        index=["config.dtype", "config"], columns="variant", values=col, sort=False, dropna=False
    )


t, mem = pivot(main, "metrics.step_s_median"), pivot(main, "metrics.peak_gib")
floor = pivot(main, "floor_s")
summary = runs[runs["variant"] == "summary"].copy()
summary = summary[summary["env.time"].isin(main["env.time"])].sort_values("env.time")
summary = summary.drop_duplicates(["config.dtype", "metrics.config"], keep="last")
ci = summary.set_index(["config.dtype", "metrics.config"]).reindex(t.index)
r = pd.DataFrame(
    {
        "ур.0/эталон, время": t["level0"] / t["reference"],
        "90% ДИ от": ci["metrics.l0/ref 90% CI lo"],
        "90% ДИ до": ci["metrics.l0/ref 90% CI hi"],
        "ур.0/эталон, память": mem["level0"] / mem["reference"],
        "ур.2/ур.0, время": t["level2"] / t["level0"],
        "ур.2/эталон, память": mem["level2"] / mem["reference"],
        "ур.1/ур.0, время": t["level1"] / t["level0"],
        "ур.1/ур.0, модель": floor["level1"] / floor["level0"],
        "ур.1/ур.0, память": mem["level1"] / mem["level0"],
        "ур.1/checkpoint, память": mem["level1"] / mem["checkpoint"],
        "checkpoint/эталон, время": t["checkpoint"] / t["reference"],
        "ур.0, доля опорной скорости": pivot(main, "of_ceiling")["level0"],
    }
)
r.index.names = ["dtype", "конфигурация"]

# The other stack against the main grid, where the log has both: each variant's step time and
# peak memory at the (dtype, config) both stacks measured, and level 1 over level 0 in each.
OTHER_STACK = stack_name(not MAIN_RESIDUAL)
stack_cmp = pd.DataFrame()
stack_l1 = pd.DataFrame()
if len(other):
    cols = ["metrics.step_s_median", "metrics.peak_gib"]
    key = ["config.dtype", "config", "variant"]
    both = main[[*key, *cols]].merge(other[[*key, *cols]], on=key, suffixes=("", " other"))
    stack_cmp = pd.DataFrame(
        {
            "dtype": both["config.dtype"],
            "конфигурация": both["config"],
            "вариант": both["variant"].map(NAMES),
            f"шаг, мс: {MAIN_STACK}": both["metrics.step_s_median"] * 1e3,
            f"шаг, мс: {OTHER_STACK}": both["metrics.step_s_median other"] * 1e3,
            "шаг: отношение": both["metrics.step_s_median other"] / both["metrics.step_s_median"],
            f"пик, ГБ: {MAIN_STACK}": both["metrics.peak_gib"],
            f"пик, ГБ: {OTHER_STACK}": both["metrics.peak_gib other"],
            "пик: отношение": both["metrics.peak_gib other"] / both["metrics.peak_gib"],
        }
    ).set_index(["dtype", "конфигурация", "вариант"])
    t_other, mem_other = pivot(other, "metrics.step_s_median"), pivot(other, "metrics.peak_gib")
    on_both = t.index.intersection(t_other.index, sort=False)  # in the main grid's order
    stack_l1 = pd.DataFrame(
        {
            f"ур.1/ур.0, время: {MAIN_STACK}": t["level1"] / t["level0"],
            f"ур.1/ур.0, время: {OTHER_STACK}": t_other["level1"] / t_other["level0"],
            f"ур.1/ур.0, память: {MAIN_STACK}": mem["level1"] / mem["level0"],
            f"ур.1/ур.0, память: {OTHER_STACK}": mem_other["level1"] / mem_other["level0"],
        }
    ).reindex(on_both)
    stack_l1.index.names = ["dtype", "конфигурация"]
GEMM_RATIO = COUNTED["checkpoint", MAIN_RESIDUAL] / COUNTED["reference", MAIN_RESIDUAL]
# GPU-bound: the model step time (GEMMs at the reference rate, bytes at the copy rate) is at
# least 80% of the measured step
gpu_bound = pivot(main, "floor_frac")["reference"] >= 0.8

SEED_COLS = ["batch_size", "seq_len", "hidden_dim", "intermediate_size", "num_layers"]
fp32 = m[(m["config.dtype"] == "fp32") & m["variant"].isin(["level0", "level1"])]
seed_rows = []
for shape in SEED_GRID:
    here = fp32[(fp32[SHAPE].to_numpy() == shape).all(axis=1)]
    bare = here[~here["residual"]]
    here = bare if len(bare) else here  # the assignment's stack where it was measured
    for level in (0, 1):
        rec = here[here["variant"] == f"level{level}"]
        row = dict(zip(SEED_COLS, shape, strict=True), checkpoint_level=level)
        if len(rec):
            rec = rec.iloc[0]
            row |= {
                "forward_time, s": rec["metrics.fwd_s_median"],
                "backward_time, s": rec["metrics.bwd_s_median"],
                "peak_memory, GB": rec["metrics.peak_gib"],
                "шаг, s": rec["metrics.step_s_median"],
                "стек": stack_name(rec["residual"]),
            }
        seed_rows.append(row)
seed = pd.DataFrame(seed_rows).reindex(
    columns=[
        *SEED_COLS,
        "checkpoint_level",
        "forward_time, s",
        "backward_time, s",
        "peak_memory, GB",
        "шаг, s",
        "стек",
    ]
)
seed_pairs = seed.pivot_table(
    index=SEED_COLS,
    columns="checkpoint_level",
    sort=False,
    dropna=False,
    values=["forward_time, s", "backward_time, s", "peak_memory, GB", "шаг, s"],
)
seed_pairs = seed_pairs.reindex(
    index=pd.MultiIndex.from_tuples(SEED_GRID, names=SEED_COLS),
    columns=pd.MultiIndex.from_product([seed_pairs.columns.levels[0], [0, 1]]),
).dropna(how="all")
seed_ratio = pd.DataFrame(
    {
        f"{label} ур.1/ур.0": seed_pairs[col][1] / seed_pairs[col][0]
        for label, col in [
            ("forward", "forward_time, s"),
            ("backward", "backward_time, s"),
            ("шаг", "шаг, s"),
            ("память", "peak_memory, GB"),
        ]
    },
    index=seed_pairs.index,
).dropna(how="all")


def shape_label(shape):
    b, s, h, i, n = shape
    return f"{b}x{s} h{h} i{i} L{n}"


def span(s, fmt="{:.2f}"):
    """'lo–hi' of a series (one value if they agree), 'не измерено' if empty."""
    s = pd.Series(s).dropna()
    if s.empty:
        return NOT_MEASURED
    lo, hi = fmt.format(s.min()), fmt.format(s.max())
    return lo if lo == hi else f"{lo}–{hi}"


PROVENANCE = (
    f"Бенчмарк: {MACHINE}, {m.groupby(KEY).ngroups} сочетаний (dtype, конфигурация, стек) из "
    f"{runs['env.time'].nunique()} прогон(ов); журналы, коммит и теги GPU — в приложении. {STACK_NOTE}"
)


big = shape_label(SEED_GRID[-1])
big_ref = main[
    (main["config"] == big) & (main["config.dtype"] == "fp32") & (main["variant"] == "reference")
]
if len(big_ref):
    b = big_ref.iloc[0]
    n_tok = b["config.batch_size"] * b["config.seq_len"]
    itemsize = torch.empty((), dtype=torch.float32).element_size()
    four = 4 * n_tok * b["config.intermediate_size"] * itemsize * b["config.num_layers"] / 2**30
    why = (
        f"на {big} (fp32, {STACK}, {MACHINE}) пик эталона {b['metrics.peak_gib']:.2f} ГБ: веса, вход и градиент выхода — "
        f"{b['metrics.base_gib']:.2f} ГБ, остальное — активации (4 тензора N×I на слой: {four:.2f} ГБ по расчёту) "
        f"и градиенты весов; активации растут с числом токенов, веса — нет"
    )
else:
    why = NOT_MEASURED
seed_measured = seed.dropna(subset=["шаг, s"])
if len(seed_ratio):
    last = seed_pairs.iloc[-1]
    last_label = shape_label(last.name)
    stacks = ", ".join(sorted(set(seed_measured["стек"])))
    comparison = (
        f"{len(seed_measured)} из {len(seed)} строк измерено ({MACHINE}, fp32, стек {stacks}). Уровень 1 против уровня 0: "
        f"forward ×{span(seed_ratio['forward ур.1/ур.0'], '{:.3f}')}, "
        f"backward ×{span(seed_ratio['backward ур.1/ур.0'])}, пиковая память ×{span(seed_ratio['память ур.1/ур.0'])}; "
        f"на {last_label}: {measured(last['peak_memory, GB'][0], '.2f', missing=NOT_MEASURED)} → "
        f"{measured(last['peak_memory, GB'][1], '.2f', ' ГБ', NOT_MEASURED)}, backward "
        f"{measured(last['backward_time, s'][0], '.3f', missing=NOT_MEASURED)} → "
        f"{measured(last['backward_time, s'][1], '.3f', ' с', NOT_MEASURED)}"
    )
    saving = 1 - seed_ratio["память ур.1/ур.0"]
    conclusion = (
        f"уровень 1 меняет память на время (сетка задания, fp32): пик на {span(saving, '{:.0%}')} ниже, шаг в "
        f"{span(seed_ratio['шаг ур.1/ур.0'])} раза дольше; экономия больше там, где активации "
        f"(∝ токены) велики по сравнению с весами и их градиентами (∝ hidden_dim)"
    )
else:
    comparison = conclusion = (
        f"{NOT_MEASURED}: конфигураций сетки задания в журналах нет ({MACHINE})"
    )
ratio_l1 = r["ур.1/ур.0, время"]


def times(s):
    """'×lo–hi' of a ratio series, or 'не измерено'."""
    text = span(s)
    return text if text == NOT_MEASURED else f"×{text}"


answers = [
    Answer("Почему важно не хранить активации для backward", why, "Описание"),
    Answer(
        "Хранить активации MLP или отдать память вниманию",
        f"пересчитывать MLP: уровень 1 повторяет 2 из {COUNTED['reference', MAIN_RESIDUAL]:.0f} GEMM "
        f"слоя, шаг {times(ratio_l1)} уровня 0, пиковая память {times(r['ур.1/ур.0, память'])} "
        f"(основная сетка, {STACK})",
        "Описание",
    ),
    Answer(
        "`MemoryOptimizedSwigluMLPFunction`, уровни 0 и 1",
        "`effdl.ops.swiglu`: уровень 0 хранит $A=xW$, $B=xV$, $G$; уровень 1 — только $x, W, V, U$ и "
        "пересчитывает $A, B, G$ в backward",
        "Реализация",
    ),
    Answer(
        "Формулы градиентов",
        r"$\bar U=G^\top\bar Y$, $\bar G=\bar Y U^\top$, $\bar B=\bar G\odot\mathrm{SiLU}(A)$, "
        r"$\bar A=\bar G\odot B\odot\mathrm{SiLU}'(A)$, $\bar W=X^\top\bar A$, $\bar V=X^\top\bar B$, "
        r"$\bar X=\bar A W^\top+\bar B V^\top$",
        "Формулы градиентов",
    ),
    Answer(
        "Проверка против `SwigluMLP` (atol 1e-4)",
        "выход и градиенты по W, V, U и x совпадают на уровнях 0, 1, 2; проверка исполняется ниже на "
        "CPU и останавливает ноутбук при расхождении",
        "Проверка корректности",
    ),
    Answer(
        "Время forward/backward и память по `checkpoint_level`",
        comparison,
        "Таблица по сетке задания",
    ),
    Answer("Выводы", conclusion, "Выводы"),
]


def provenance_table():
    """One row per log under results/swiglu/: its commit, GPU, GPU tag (env.gpu_id) and number
    of runs (distinct env.run_id)."""
    table = log_provenance(envs_by_log(raw))
    return table.rename(
        columns={"log": "журнал", "git sha": "коммит", "GPU tag(s)": "тег GPU", "runs": "прогонов"}
    )


provenance = provenance_table()


# The replicate on another GPU (the fp32 configurations it reached): the benchmark's own per-config
# ratios beside the main grid's, for the appendix.
REPLICATE_COLS = {"metrics.l0/ref time": "ур.0/эталон, время", "metrics.l1/l0 time": "ур.1/ур.0, время",
                  "metrics.l2/l0 time": "ур.2/ур.0, время", "metrics.l1/ckpt mem": "ур.1/checkpoint, память"}  # fmt: skip


def replicate_table():
    """Per (dtype, config) the replicate log holds: each ratio in the main grid and in the
    replicate, with the replicate's GPU and tag; an empty frame where no replicate log exists."""
    rep = pd.DataFrame(
        log_records(SWIGLU, ("benchmark*.jsonl", "benchmark*.jsonl.gz"), replicate=True)
    )
    if not rep.empty:  # a replicate of the main grid's stack only
        rep = rep[rep["env.run_id"].map(stack_of_runs(rep)) == MAIN_RESIDUAL]
    if rep.empty:
        return rep, ""
    rep = rep[rep["variant"] == "summary"].set_index(["config.dtype", "metrics.config"])
    base = summary.set_index(["config.dtype", "metrics.config"]).reindex(rep.index)
    cols = {}
    for col, name in REPLICATE_COLS.items():
        cols[(name, "основной")] = base[col]
        cols[(name, "повтор")] = rep[col]
    table = pd.DataFrame(cols)
    table.index.names = ["dtype", "конфигурация"]
    env = rep.iloc[0]
    where = f"{device_name(env)}, тег {env['env.gpu_id']}, коммит {str(env['env.git_sha'])[:7]}"
    return table, where


replicate, REPLICATE_WHERE = replicate_table()
