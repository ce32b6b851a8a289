"""Loads the GPU reference-rate log (reports/results/ceilings/) for gpu_ceilings.ipynb.

Builds the best dense-GEMM rate per dtype over the square sizes measured, the device-to-device
copy bandwidth, the datasheet figures they are set against (only where the log's GPU is the
datasheet's), the roofline ridge point every report uses, and the rows of the report's answers
table. It displays nothing: the notebook runs it with ``%run -i`` and shows the tables.
"""

import os

from effdl.answers import Answer
from effdl.results import device_name, load_results, results_dir
from effdl.tables import measured

# NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 column (the GPU in the log, "NVIDIA H100 80GB
# HBM3", is the SXM part). The datasheet's tensor-core figures are "with sparsity"; the dense
# figures are half of them: bf16/fp16 1,979 -> 989, tf32 989 -> 494.7 TFLOP/s.
DATASHEET_TFLOPS = {
    "bf16": 989.0,  # dense bf16 tensor core
    "fp16": 989.0,  # dense fp16 tensor core
    "tf32": 494.7,  # dense tf32 tensor core
    "fp32": 66.9,  # fp32 without tensor cores (datasheet: 67); allow_tf32 is off for this row
}
DATASHEET_HBM_GBPS = 3350.0  # HBM3, 3.35 TB/s
DATASHEET_GPU = "NVIDIA H100 80GB HBM3"  # the figures above describe this GPU only
# The bf16 peak and memory bandwidth the reports' ridge points use, from NVIDIA's datasheets: the
# H200 SXM has the H100 SXM's compute with HBM3e at 4.8 TB/s; seed 002 quotes 989 TFLOP/s and 4 TB/s.
RIDGE_PAIRS = {  # name: (dense bf16 TFLOP/s, memory TB/s)
    "H100 SXM datasheet": (989.0, 3.35),
    "H200 SXM datasheet": (989.0, 4.8),
    "seed 002's figures (lm_training.ipynb, Deliverable 6)": (989.0, 4.0),
}


def ridge(tflops, tb_s):
    """The roofline ridge in FLOP/B: a peak compute rate over a peak memory bandwidth. Below that
    many FLOP per byte moved, bandwidth sets a kernel's floor."""
    return tflops / tb_s


RESULTS = results_dir("results")
df = load_results(RESULTS / "ceilings")
latest = df[df["env.time"] == df["env.time"].max()]  # the most recent run only
env = latest.iloc[0]
device = device_name(env)
# The datasheet is set against the measured rates only where they were measured on its GPU.
DATASHEET = device == DATASHEET_GPU
SOURCE = (
    f"logs: {os.path.relpath(RESULTS / 'ceilings')}\ndevice: {device}, torch {env['env.torch']}"
)
if not DATASHEET:
    SOURCE += (
        f"\nMeasured on {device}, not the {DATASHEET_GPU} (H100 SXM) whose datasheet figures this "
        "notebook quotes: they are not comparable, so no datasheet column or line is shown."
    )

gemm = latest[latest["config.op"] == "matmul"].copy()
gemm["n"] = gemm["config.n"].astype(int)
gemm["dtype"] = gemm["config.dtype"]
copy = latest[latest["config.op"] == "copy"]
best = gemm.groupby("dtype")["metrics.tflops"].max()  # the best of the square sizes measured
order = [d for d in DATASHEET_TFLOPS if d in best.index]

RIDGE = ridge(*RIDGE_PAIRS["H100 SXM datasheet"])  # the GPU of this log
COPY = copy["metrics.gb_per_s"].max() if len(copy) else None
GEMMS, COPIES, USING = (
    "Dense GEMMs against the datasheet",
    "Copy bandwidth",
    "The ridge point and how to use these rates",
)


def rate(d):
    if d not in best.index:
        return "not measured"
    n = int(gemm.loc[gemm[gemm["dtype"] == d]["metrics.tflops"].idxmax(), "n"])
    said = f"{best[d]:.4g} TFLOP/s (square {n}^3, the best size measured)"
    return said + (f", {best[d] / DATASHEET_TFLOPS[d]:.0%} of the datasheet's {DATASHEET_TFLOPS[d]:g}"
                   if DATASHEET else f" on {device}")  # fmt: skip


answers = [Answer(f"dense {d} GEMM rate reached", rate(d), GEMMS) for d in DATASHEET_TFLOPS]
answers.append(
    Answer(
        "memory bandwidth reached",
        measured(COPY, ".4g", " GB/s (device-to-device copy, read + write)")
        + (
            f", {COPY / DATASHEET_HBM_GBPS:.0%} of the datasheet's {DATASHEET_HBM_GBPS / 1e3:g} TB/s"
            if DATASHEET and COPY
            else ""
        ),
        COPIES,
    )
)
answers.append(
    Answer(
        "is the measured GEMM rate an upper bound?",
        "no: it is a reference rate, what one square GEMM of random data sustained; other "
        "shapes and data can run faster, and only the datasheet peak bounds a kernel",
        USING,
    )
)
answers.append(
    Answer(
        "roofline ridge point (bf16)",
        f"{RIDGE:.0f} FLOP/B = {RIDGE_PAIRS['H100 SXM datasheet'][0]:g} TFLOP/s / "
        f"{RIDGE_PAIRS['H100 SXM datasheet'][1]:g} TB/s (H100 SXM datasheet pair); the same "
        "definition gives "
        + ", ".join(
            f"{ridge(*v):.0f} for {k.split(' (')[0]}"
            for k, v in RIDGE_PAIRS.items()
            if k != "H100 SXM datasheet"
        ),
        USING,
    )
)
