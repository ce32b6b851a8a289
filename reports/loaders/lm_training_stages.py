"""Loads the speed-up study's logs (reports/results/lm_training/) for lm_training_stages.ipynb.

Builds what the report's sections read: the study's stages (speedup_stages.jsonl) and the same
command's run on a second host (the replicate log), each stage's factor over the previous one with
its interval and one verdict over the hosts, the planted mistakes counted as found and fixed, the
profiled steps of each stage (the Chrome traces beside the log) and the profiler quantity that
shows each fix; the LayerNorm benchmark (torch's LayerNorm against effdl's fused one, the log's
``path`` naming the code that ran) and the ablation of the fused_layer_norm stage with each
LayerNorm (layer_norm_ablation_<variant>.jsonl, whichever variants are present); and the answers and
targets of the report's first two tables, the appendix's replicate and provenance tables. It
displays nothing: the notebook runs it with
``%run -i`` and shows the tables.
"""

import gzip
import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
from loaders.replicates import log_provenance  # reports/loaders/ (cwd: reports/)

from effdl.answers import Answer, Target
from effdl.data.corpus import WIKITEXT103_TRAIN_LINES, WIKITEXT103_TRAIN_TOKENS
from effdl.ops.layer_norm import TRITON_MIN_BYTES
from effdl.profiling.timing import median_ratio_ci
from effdl.results import device_name, find_log, read_records, results_dir
from effdl.tables import MISSING, is_missing

RESULTS = results_dir("results")
LM = RESULTS / "lm_training"
NOT_MEASURED = MISSING
TARGET_TOTAL = 10.0
TARGET_FRAC_COPY = 0.8
LARGE_ELEMENTS = 2**25  # a "large" LayerNorm shape: at least 32M elements (tokens x hidden)
RANGES = ["data_wait", "to_device", "forward", "backward", "optimizer"]
S_METHOD = "How the study runs"
S_STAGES = "The speed-up, stage by stage"
S_STEP = "Where each stage's step time goes; memory; the loss curves"
S_PROFILE = "Each fix in the profile"
S_LN = "The fused LayerNorm"
S_LN_PATH = "The fused_layer_norm stage with each LayerNorm"
S_FLOOR = "The step against the datasheet rates"
S_APPENDIX = "Appendix: replicate and runs"


def stage_records(recs):
    """The measured stages of one run's records (the last record of each stage), in order."""
    of_stage = {r["config"]["stage"]: r for r in recs}
    return [of_stage[i] for i in sorted(of_stage) if not of_stage[i]["metrics"].get("skipped")]


def host(r):
    return r["env"].get("gpu_id") or r["env"].get("gpu") or "CPU"


def name(r):
    return f"{r['config']['stage']}: {r['config']['fix']}"


def factor(prev, r):
    """(speed-up of ``r`` over ``prev`` in real tokens/s, its 90% bootstrap interval)."""
    lo, hi = median_ratio_ci(prev["metrics"]["step_s"], r["metrics"]["step_s"])
    return r["metrics"]["tokens_per_s"] / prev["metrics"]["tokens_per_s"], lo, hi


def verdict(lo, hi):
    return "faster" if lo > 1 else "slower" if hi < 1 else "within noise"


# The study: one run on one host (speedup_stages.jsonl), the same command on other hosts in the
# replicate log (told apart by env.gpu_id): together they give the run-to-run noise.
MAIN_LOG = find_log(LM / "speedup_stages.jsonl")
all_main = read_records(MAIN_LOG)
measured = stage_records(all_main)
first, last = measured[0], measured[-1]
CFG, ENV = first["config"], first["env"]
GPU = device_name(ENV)
DATA = f"real text: the Python standard library ({CFG['corpus']}), BPE {CFG['vocab_size']}"
# seed 001 trains on WikiText-103, a document per line; the study's stand-in and its lengths
WIKI_PER_LINE = WIKITEXT103_TRAIN_TOKENS / WIKITEXT103_TRAIN_LINES
STAND_IN = (
    f"*Stand-in data: seed 001 trains on WikiText-103, a document per line ({WIKITEXT103_TRAIN_LINES:,} "
    f"lines and {WIKITEXT103_TRAIN_TOKENS:,} word tokens in the published train split, "
    f"{WIKI_PER_LINE:.1f} per line, blank lines included); the project downloads no data, so the study "
    f"trains on the Python standard library's documentation and source cut into paragraphs "
    f"({CFG['documents']:,} paragraphs, {CFG['mean_document_tokens']:.1f} BPE tokens each on average "
    f"after truncation to {CFG['max_length']}). The units differ (WikiText's word tokens, our BPE "
    "tokens); in both, the mean document is a small fraction of the maximum length, which is what "
    "padding wastes and packing recovers.*"
)
REPLICATE_LOG = find_log(LM / "speedup_stages_replicate.jsonl")
by_host = {}
for r in read_records(REPLICATE_LOG) if REPLICATE_LOG.exists() else []:
    by_host.setdefault(host(r), []).append(r)
RUNS = [measured] + [recs for recs in map(stage_records, by_host.values()) if len(recs) > 1]
by_fix = {r["config"]["fix"]: r for r in measured[1:]}
prev_of = {r["config"]["fix"]: p for p, r in itertools.pairwise(measured)}
runs_factors = {}  # fix -> [(x, lo, hi) per run], the main run first
for recs in RUNS:
    for p, r in itertools.pairwise(recs):
        runs_factors.setdefault(r["config"]["fix"], []).append(factor(p, r))


def over_runs(fix):
    """faster / slower only where every run says so with its interval excluding 1."""
    says = {verdict(lo, hi) for _, lo, hi in runs_factors[fix]}
    return says.pop() if len(says) == 1 else "within noise"


def total_of(recs):
    x, lo, hi = factor(recs[0], recs[-1])
    return x, lo, hi


total, total_lo, total_hi = total_of(measured)


# The profiled steps of each stage (Chrome traces committed beside the log).
KERNELS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")


def trace_file(r):
    base = Path(r["metrics"]["trace"]).name
    for p in (LM / "traces" / "stages" / base, LM / "traces" / base, Path(r["metrics"]["trace"])):
        if p.exists():
            return p
    return None


class Trace:
    """The complete events of one stage's profiled steps, each placed in its step range."""

    def __init__(self, r):
        self.n = r["config"]["profile_steps"]
        with gzip.open(trace_file(r), "rt", encoding="utf-8") as f:
            self.events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
        self.spans = {k: [] for k in (*RANGES, "step")}
        for e in self.events:
            if e.get("cat") == "user_annotation" and e["name"] in self.spans:
                self.spans[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
        launch = {e["args"]["correlation"]: e["ts"] for e in self.events
                  if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}  # fmt: skip
        for e in self.events:
            ts = (
                launch.get(e.get("args", {}).get("correlation"))
                if e.get("cat") in KERNELS
                else e["ts"]
            )
            e["range"] = self.where(ts)

    def where(self, ts):
        if ts is None:
            return None
        for k in RANGES:
            if any(a <= ts <= b for a, b in self.spans[k]):
                return k
        return "host_gap" if any(a <= ts <= b for a, b in self.spans["step"]) else None

    def count(self, cat, names=None, where=None, contains=None):
        """(calls per step, ms per step) of matching events."""
        sel = [e for e in self.events if e.get("cat") == cat
               and (names is None or e["name"] in names)
               and (contains is None or contains in e["name"])
               and (where is None or e["range"] == where)]  # fmt: skip
        return len(sel) / self.n, sum(e["dur"] for e in sel) / 1e3 / self.n

    def kernels(self, where=None):
        return sum(self.count(c, where=where)[0] for c in KERNELS)


traces = {r["config"]["stage"]: Trace(r) for r in measured if trace_file(r)}
has_kernels = any(t.kernels() for t in traces.values())
LN_TRITON_KERNELS = ("_forward_kernel", "_backward_kernel", "_sum_partials_kernel")


def is_ln_kernel(e):
    """aten's LayerNorm kernels (dγ/dβ included) or effdl's Triton ones. A trace whose dγ/dβ
    partial sums ran as a generic aten reduce kernel leaves those out: it cannot be told from
    the model's other reductions by name."""
    n = e["name"]
    return e.get("cat") == "kernel" and (
        "layer_norm" in n or "GammaBeta" in n or n in LN_TRITON_KERNELS
    )


def gemm_ms(t):
    return sum(e["dur"] for e in t.events if e.get("cat") == "kernel"
               and ("gemm" in e["name"].lower() or "nvjet" in e["name"])) / 1e3 / t.n  # fmt: skip


# what zero_grad runs without set_to_none
ZEROING_OPS = {"aten::_foreach_zero_", "aten::zero_", "aten::fill_"}
# fix -> (what the profiler row shows, its short name, how to read it from a trace)
EVIDENCE = {
    "amp": ("GEMM kernel time per step, ms (fp32 sgemm -> fp16 tensor-core GEMMs)",
            "GEMM ms/step", gemm_ms),
    "packing": ("GPU kernel time per step, ms (padding computed)", "kernel ms/step",
                lambda t: sum(t.count(c)[1] for c in KERNELS)),
    "no_empty_cache": ("cudaFree + cudaMalloc calls per step (the allocator's blocks returned, "
                       "then taken again)", "cudaFree + cudaMalloc/step",
                       lambda t: t.count("cuda_runtime", {"cudaFree", "cudaMalloc"})[0]),
    "loss_read_once": ("aten::item + cudaStreamSynchronize after the step's ranges, calls/step",
                       "item + sync calls/step",
                       lambda t: t.count("cpu_op", {"aten::item"}, "host_gap")[0]
                       + t.count("cuda_runtime", {"cudaStreamSynchronize"}, "host_gap")[0]),
    "grads_to_none": ("zero_grad's zeroing ops in the optimizer range (aten::_foreach_zero_, "
                      "zero_ or fill_), calls/step", "zeroing ops/step",
                      lambda t: t.count("cpu_op", ZEROING_OPS, "optimizer")[0]),
    "loader_workers": ("host time in data_wait (collation in the training process), ms/step",
                       "data_wait ms/step",
                       lambda t: sum(b - a for a, b in t.spans["data_wait"]) / 1e3 / t.n),
    "async_copy": ("cudaStreamSynchronize inside to_device (blocking copies), calls/step",
                   "syncs in to_device/step",
                   lambda t: t.count("cuda_runtime", {"cudaStreamSynchronize"}, "to_device")[0]),
    "masks_from_loader": ("GPU kernels launched in forward (masks built on the device), per step",
                          "forward kernels/step", lambda t: t.kernels("forward")),
    "fused_adam": ("GPU kernels launched in the optimizer range, per step",
                   "optimizer kernels/step", lambda t: t.kernels("optimizer")),
    "fused_layer_norm": ("LayerNorm kernel time per step, ms (aten's or the Triton kernels)",
                         "LayerNorm kernel ms/step",
                         lambda t: sum(e["dur"] for e in t.events if is_ln_kernel(e)) / 1e3 / t.n),
    "compile": ("GPU kernels per step (fusion)", "kernels/step", lambda t: t.kernels()),
}  # fmt: skip
# the fixes whose evidence counts GPU kernels or CUDA calls: none in a CPU trace
GPU_EVIDENCE = {"amp", "packing", "no_empty_cache", "async_copy",
                "masks_from_loader", "fused_adam", "fused_layer_norm", "compile"}  # fmt: skip


def evidence(fix):
    """(how the profiler shows ``fix``, before (previous stage), after) from the traces."""
    shows, _, fn = EVIDENCE.get(fix, ("", "", None))
    r = by_fix.get(fix)
    before = traces.get(prev_of[fix]["config"]["stage"]) if r else None
    after = traces.get(r["config"]["stage"]) if r else None
    if fn is None or before is None or after is None or (not has_kernels and fix in GPU_EVIDENCE):
        return shows, np.nan, np.nan
    return shows, fn(before), fn(after)


def stage_answer(fix, fixed="fixed"):
    """A stage's factor over the previous stage with its interval (the main run), the verdict
    over all runs and the profiler row before -> after (the replicate's factor: the appendix)."""
    if fix not in by_fix:
        return MISSING
    x, lo, hi = runs_factors[fix][0]
    v = over_runs(fix)
    head = fixed if v == "faster" else f"tried, {'slower' if v == 'slower' else 'within noise'}"
    _, b, a = evidence(fix)
    profile = "" if is_missing(b) else f"; {EVIDENCE[fix][1]} {b:.3g} -> {a:.3g}"
    return f"{head}, {x:.2f}x [{lo:.2f}-{hi:.2f}]{profile}"


def peak(fix):
    """Peak memory of the previous stage -> ``fix``'s stage."""
    r = by_fix.get(fix)
    if r is None or is_missing(r["metrics"].get("peak_mem_gib")):
        return f"peak memory {MISSING}"
    return (f"peak memory {prev_of[fix]['metrics']['peak_mem_gib']:.2f} -> "
            f"{r['metrics']['peak_mem_gib']:.2f} GiB")  # fmt: skip


def with_peak(fix):
    return f"{stage_answer(fix, 'faster')}; {peak(fix)}" if fix in by_fix else MISSING


# The LayerNorm benchmark: torch's nn.LayerNorm against effdl's fused LayerNorm and its variants; each
# variant's ``path`` in the log names the code that ran.
def ln_summary(records):
    s = pd.DataFrame(
        [{**r["config"], **r["metrics"]} for r in records if r["variant"] == "summary"]
    )
    s = s.drop_duplicates(["shape", "dtype"], keep="last")
    s["elements"] = s["tokens"] * s["hidden"]
    s["bytes"] = s["elements"] * s["dtype"].map({"bf16": 2, "fp16": 2, "fp32": 4})
    return s


def ln_paths(records):
    """Each variant's path in a log, "/"-joined where it took more than one (by input size)."""
    paths = {}
    for r in records:
        if "path" in r["metrics"]:
            paths.setdefault(r["variant"], set()).add(r["metrics"]["path"])
    return {v: "/".join(sorted(p)) for v, p in paths.items()}


LN_LOG = find_log(LM / "layer_norm_benchmark.jsonl")
ln_records = read_records(LN_LOG)
summary = ln_summary(ln_records)
LN_ENV = ln_records[-1]["env"]
HAS_GRAPH = "fused graph frac copy" in summary
summary_paths = ln_paths(ln_records)


def triton_view(s):
    """``s`` with the kernel-time columns of ``fused`` taken from the ``triton`` variant (the Triton
    kernels at every size) where the log has one; the eager columns stay FusedLayerNorm's."""
    if "triton graph ms" not in s:
        return s
    s = s.copy()
    s["fused graph ms"] = s["triton graph ms"]
    s["fused graph frac copy"] = s["triton graph frac copy"]
    s["graph torch/fused"] = s["torch graph ms"] / s["triton graph ms"]
    return s


# The Triton kernels launched from Python (kernel[grid](...)) at every size: the benchmark log's
# ``triton`` variant.
TRITON = triton_view(summary)
TRITON_GRAPH = "fused graph frac copy" in TRITON


def ln_kernel_answer(s):
    """Kernel time (CUDA graph) torch / Triton at the bf16 shapes."""
    if "graph torch/fused" not in s:
        return f"kernels alone {MISSING}"
    bf = s[s["dtype"] == "bf16"]["graph torch/fused"]
    return f"the Triton kernels alone {bf.min():.2f}-{bf.max():.2f}x faster than torch's (bf16, kernel time)"


# The fused_layer_norm stage with each LayerNorm (speedup_stages.py --stages <before>,<it>
# --layer-norm ..., the variants' processes alternating on one host): one log per variant,
# layer_norm_ablation_<variant>.jsonl. Every process also trains the stage before (nn.LayerNorm),
# the two taking turns, so each variant is compared with nn.LayerNorm inside its own process.
ABLATION_LABELS = {"torch_kernel": "torch's kernel", "triton_kernels": "the Triton kernels"}
ABLATION_PREFIX = "layer_norm_ablation_"
ablation_keys = {p.name.removeprefix(ABLATION_PREFIX).split(".")[0]
                 for p in LM.glob(f"{ABLATION_PREFIX}*.jsonl*")}  # fmt: skip
ABLATION = {k: ABLATION_LABELS.get(k, k)
            for k in sorted(ablation_keys, key=lambda k: (k != "torch_kernel", k))}  # fmt: skip
ablation, ablation_before = {}, {}  # variant -> its runs' records of the stage / the one before
for key in ABLATION:
    for r in read_records(find_log(LM / f"{ABLATION_PREFIX}{key}.jsonl")):
        side = ablation if r["config"]["fix"] == "fused_layer_norm" else ablation_before
        side.setdefault(key, []).append(r)
LN_STAGE = next((r["config"]["stage"] for v in ablation.values() for r in v), None)
LN_BEFORE = f"stage {LN_STAGE - 1} (nn.LayerNorm)" if LN_STAGE else None
# aten's LayerNorm kernels are templated on the input's dtype (their first template argument)
ATEN_LN_DTYPES = {"float": ("fp32", 4), "c10::Half": ("fp16", 2), "c10::BFloat16": ("bf16", 2)}


def study_ln_input():
    """(dtype, bytes) of the study's LayerNorm input (packed rows x max length x d_model), the
    dtype read from aten's LayerNorm kernels in the trace of the stage before fused_layer_norm;
    (None, None) where that trace has no kernels (a CPU run)."""
    prev = prev_of.get("fused_layer_norm")
    t = traces.get(prev["config"]["stage"]) if prev else None
    args = [e["name"].split("<", 1)[1].split(",")[0].strip()
            for e in (t.events if t else []) if is_ln_kernel(e) and "<" in e["name"]]  # fmt: skip
    known = [ATEN_LN_DTYPES[a] for a in args if a in ATEN_LN_DTYPES]
    if not known:
        return None, None
    dtype, size = known[0]
    return dtype, CFG["rows_packed"] * CFG["max_length"] * CFG["d_model"] * size


STUDY_LN_DTYPE, STUDY_LN_BYTES = study_ln_input()
# the kernels FusedLayerNorm runs for that input on CUDA (effdl.ops.layer_norm.kernel_path)
STUDY_LN_PATH = (
    None
    if STUDY_LN_BYTES is None
    else "torch's kernel"
    if STUDY_LN_BYTES < TRITON_MIN_BYTES
    else "the Triton kernels"
)


def step_factors(num, den):
    """Per run i: (median step of num[i] / median step of den[i], its 90% bootstrap interval);
    > 1: den's step is the shorter."""
    return [
        (float(np.median(n["metrics"]["step_s"]) / np.median(d["metrics"]["step_s"])),
         *median_ratio_ci(n["metrics"]["step_s"], d["metrics"]["step_s"]))
        for n, d in zip(num, den, strict=False)
    ]  # fmt: skip


def factor_list(fs):
    return ", ".join(f"{x:.2f}x [{lo:.2f}-{hi:.2f}]" for x, lo, hi in fs)


def ablation_factors(key):
    """Per run of ``key``: the fused_layer_norm stage against the stage before in the same
    process (> 1: faster than nn.LayerNorm), with its 90% interval."""
    return step_factors(ablation_before.get(key, []), ablation[key])


def ablation_answer():
    """The Triton kernels in place of torch's in the fused_layer_norm stage, against nn.LayerNorm
    in the same process, per run (> 1: faster)."""
    if "triton_kernels" not in ablation or not ablation_before:
        return f"with the Triton kernels {MISSING}"
    fs = ablation_factors("triton_kernels")
    return f"with the Triton kernels instead {', '.join(f'{x:.2f}x' for x, _, _ in fs)} ({len(fs)} runs)"


def ln_training_answer():
    """The fused_layer_norm stage in the study (the kernels its input takes), the same stage with
    the Triton kernels, and the Triton kernels alone."""
    if "fused_layer_norm" not in by_fix:
        return MISSING
    where = "" if STUDY_LN_PATH is None else f" ({STUDY_LN_PATH} at its input)"
    return (f"in the study{where}: {with_peak('fused_layer_norm')}; {ablation_answer()}; "
            f"{ln_kernel_answer(TRITON)}")  # fmt: skip


# The loop mistakes planted in stage 0 (the stages between the setup and the bonuses); the stages
# before them fix the setup of the AMP and data parts, the ones after are the bonuses.
SETUP, BONUSES = ("amp", "packing"), ("fused_layer_norm", "compile")
PLANTED = [fix for fix in by_fix if fix not in SETUP + BONUSES]
FIXED = [fix for fix in PLANTED if over_runs(fix) == "faster"]
TRIED = [fix for fix in PLANTED if fix not in FIXED]
REQUIRED_FIXES = 5
MISTAKES = {  # fix -> the mistake it removes, as the answers table names it
    "loader_workers": "DataLoader without workers or pinned memory",
    "no_empty_cache": "torch.cuda.empty_cache() after every step",
    "fused_adam": "Adam as a per-parameter loop",
    "async_copy": "blocking host-to-device copies",
    "masks_from_loader": "attention masks rebuilt in the step",
    "loss_read_once": "the loss read and printed every step",
    "grads_to_none": "zero_grad fills gradients with zeros",
}


def count_answer():
    """How many planted mistakes were found and fixed (faster beyond noise in every run)."""
    every = {1: "the one host", 2: "both hosts"}.get(len(RUNS), f"all {len(RUNS)} hosts")
    return (f"{len(FIXED)} of {len(PLANTED)}, faster beyond noise on {every}; tried, not a fix: "
            f"{', '.join(f'{f} ({over_runs(f)})' for f in TRIED) or 'none'}; "
            f"{REQUIRED_FIXES} needed: {'met' if len(FIXED) >= REQUIRED_FIXES else 'not met'}")  # fmt: skip


answers = [
    Answer("Setup from the AMP and data parts (stages 1-2)",
           f"AMP {CFG['amp_dtype']} {stage_answer('amp', 'faster')}; packing "
           f"{stage_answer('packing', 'faster')}", S_PROFILE),
    *[Answer(f"Inefficiency {i}: {MISTAKES.get(fix, fix)}", stage_answer(fix), S_PROFILE)
      for i, fix in enumerate(PLANTED, 1)],
    Answer("Inefficiencies found and fixed (first 5 graded)", count_answer(), S_PROFILE),
    Answer("Total speed-up; each stage's (report)",
           f"{total:.1f}x [{total_lo:.1f}-{total_hi:.1f}]: {first['metrics']['tokens_per_s']:,.0f} "
           f"-> {last['metrics']['tokens_per_s']:,.0f} real tokens/s, stage 0 -> {name(last)} "
           f"({GPU}); each stage's in the section", S_STAGES),
    Answer("Bonus: FusedLayerNorm, speed and memory", ln_training_answer(), S_LN_PATH),
    Answer("Bonus: torch.compile, speed and memory", with_peak("compile"), S_STAGES),
]  # fmt: skip


# The project's own targets (the report's second table)
def ln_eager(s):
    """FusedLayerNorm's eager step against torch's at every bf16 shape (torch's kernel below
    TRITON_MIN_BYTES, the Triton kernels above): (text, met), met where no 90% interval of
    torch/fused lies below 1."""
    bf = s[s["dtype"] == "bf16"]
    if not len(bf):
        return None, None
    lo, hi, x = bf["torch/fused 90% lo"], bf["torch/fused 90% hi"], bf["torch/fused"]
    text = (f"torch/fused {x.min():.2f}-{x.max():.2f}x: slower at {(hi < 1).sum()}, within noise "
            f"at {((lo <= 1) & (hi >= 1)).sum()}, faster at {(lo > 1).sum()} of {len(bf)} shapes")  # fmt: skip
    return text, bool((hi >= 1).all())


targets = [Target(f"total speed-up >= {TARGET_TOTAL:.0f}x in real tokens/s on the same data",
                  f"{total:.1f}x", bool(total >= TARGET_TOTAL)),
           Target(f"at least {REQUIRED_FIXES} inefficiencies found and fixed, each faster beyond "
                  "noise on every host measured", f"{len(FIXED)} ({', '.join(FIXED) or 'none'})",
                  len(FIXED) >= REQUIRED_FIXES)]  # fmt: skip
if TRITON_GRAPH:
    large = TRITON[TRITON["elements"] >= LARGE_ELEMENTS]["fused graph frac copy"]
    bf = TRITON[TRITON["dtype"] == "bf16"]["graph torch/fused"]
    targets += [
        Target(f"fused LayerNorm's Triton kernels, forward+backward >= {TARGET_FRAC_COPY:.0%} of "
               f"copy bandwidth at large shapes (>= {LARGE_ELEMENTS / 2**20:.0f}M elements), kernel time",
               f"{(large >= TARGET_FRAC_COPY).sum()} of {len(large)} (shape, dtype) pairs, "
               f"{large.min():.1%}-{large.max():.1%}", bool((large >= TARGET_FRAC_COPY).all())),
        Target("fused LayerNorm's Triton kernels at least as fast as torch's at every bf16 shape, "
               "kernel time", f"torch/Triton {bf.min():.2f}-{bf.max():.2f}x", bool((bf >= 1).all())),
    ]  # fmt: skip
else:
    targets.append(Target("fused LayerNorm: kernel-time targets (CUDA graph)", None, None))
eager_text, eager_met = ln_eager(TRITON)
targets.append(Target("FusedLayerNorm at least as fast as torch's at every bf16 shape, eager "
                      "calls (the host's cost included; 90% interval)", eager_text, eager_met))  # fmt: skip


# The appendix: the headline ratios on each host, each taken within one run; then the runs read.
def replicate_rows():
    """The total speed-up of each study run and the Triton kernels' kernel-time ratio over
    torch's at the bf16 shapes of each LayerNorm benchmark log."""
    rows = []
    for recs in RUNS:
        x, lo, hi = total_of(recs)
        rows.append({"measure": f"total speed-up, stage 0 -> {name(recs[-1])}",
                     "GPU": device_name(recs[0]["env"]), "GPU tag": host(recs[0]),
                     "ratio": f"{x:.1f}x", "interval or min..max": f"{lo:.1f}-{hi:.1f} (90%)"})  # fmt: skip
    rep_log = find_log(LM / "layer_norm_benchmark_bf16_replicate.jsonl")
    for recs in (ln_records, read_records(rep_log) if rep_log.exists() else []):
        s = triton_view(ln_summary(recs)) if recs else None
        if s is None or "graph torch/fused" not in s:
            continue
        bf = s[s["dtype"] == "bf16"]["graph torch/fused"]
        rows.append({"measure": "LayerNorm kernel time torch/Triton, bf16 shapes",
                     "GPU": device_name(recs[-1]["env"]), "GPU tag": host(recs[-1]),
                     "ratio": f"{bf.median():.2f}x (median)",
                     "interval or min..max": f"{bf.min():.2f}..{bf.max():.2f}"})  # fmt: skip
    return pd.DataFrame(rows).set_index(["measure", "GPU tag"])


def provenance():
    """One row per log the report reads: git sha, GPU model, GPU tag(s), runs (distinct run ids)."""
    paths = [
        MAIN_LOG,
        REPLICATE_LOG,
        LN_LOG,
        find_log(LM / "layer_norm_benchmark_bf16_replicate.jsonl"),
    ]
    paths += [find_log(LM / f"{ABLATION_PREFIX}{k}.jsonl") for k in ABLATION]  # fmt: skip
    logs = {p.name: [r["env"] for r in read_records(p)] for p in paths if p.exists()}
    cores = {
        log: {"CPU cores seen": ", ".join(sorted({str(e.get("cpu_count")) for e in found}))}
        for log, found in logs.items()
    }
    return log_provenance(logs, extra=cores).set_index("log")
