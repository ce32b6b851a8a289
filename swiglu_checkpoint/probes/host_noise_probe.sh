#!/bin/bash
# How noisy is a host-bound config (bf16 16x128 h512 i2048 L2) chunk to chunk, and does pinning
# the process to a few cores (taskset) change that? (probe, H100; reference vs level 0, 20
# rounds). Prints the per-chunk coefficient of variation and the level0/reference ratio.
set -e
cfg="--device cuda --dtypes bf16 --configs 16,128,512,2048,2 --variants reference level0 --rounds 20 --min-time 3"
nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node0" || true
for run in plain pin0-3 plain2 pin4-7; do
  case $run in
    pin0-3) pre="taskset -c 0-3" ;;
    pin4-7) pre="taskset -c 4-7" ;;
    *) pre="" ;;
  esac
  $pre python3 swiglu_checkpoint/benchmark.py $cfg --out "$OUT/noise_$run" > /dev/null 2>&1
  python3 - "$OUT/noise_$run/benchmark.jsonl" "$run" <<'PY'
import json, statistics as st, sys
rows = {r["variant"]: r["metrics"] for r in map(json.loads, open(sys.argv[1])) if "step_s_per_chunk" in r["metrics"]}
out = [sys.argv[2].ljust(7)]
for v, m in rows.items():
    c = m["step_s_per_chunk"]
    out.append(f"{v} median {st.median(c)*1e3:.3f} ms cv {st.stdev(c)/st.mean(c):.3f}")
out.append(f"l0/ref {st.median(rows['level0']['step_s_per_chunk'])/st.median(rows['reference']['step_s_per_chunk']):.3f}")
print(" | ".join(out))
PY
done
