"""lm_training/speedup_stages.py and its stages (effdl.lm.stages): cumulative stages, the same
real tokens in every step, the padded and the packed first step against each other in fp32, the
blocks the stages take turns in, a --quick run's records, and (CUDA) the planted empty_cache."""

import dataclasses
import gzip
import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from effdl.lm import stages as st
from effdl.models.gpt_like import GPTLikeConfig
from effdl.results import read_records
from tests.script_loading import load_script

study = load_script("lm_training", "speedup_stages")
FLAGS = [name for name, _ in st.STAGE_FLAGS]


def random_docs(n: int, max_length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 97, rng.integers(1, max_length + 1)) for _ in range(n)]


def small_stage(
    cfg: GPTLikeConfig,
    stage: st.Stage,
    device: torch.device,
    plan: st.StepPlan,
    seed: int,
    workers: int,
) -> tuple[st.StepParts, Iterator]:
    """``stage``'s step parts (bf16 where it has amp, Adam lr 1e-3, pad id 0) and its batches."""
    model = st.build_model(cfg, stage, device, seed=seed)
    optimizer = st.build_optimizer(model, stage, 1e-3)
    precision = st.stage_precision(stage, device, "bf16")
    parts = st.StepParts(model, optimizer, precision, stage, device, pad_id=0)
    return parts, iter(st.step_loader(plan, stage, 0, None, workers=workers, device=device))


def test_each_stage_adds_one_fix_to_all_earlier_ones():
    stages = st.stages()
    assert len(stages) == len(FLAGS) + 1
    assert stages[0].fixes == []
    for i, stage in enumerate(stages[1:], start=1):
        assert stage.fixes == FLAGS[:i]
        assert set(stages[i - 1].fixes) < set(stage.fixes)
    assert [st.stage_name(i) for i in (0, 1, len(FLAGS))] == [
        "stage0_baseline",
        "stage1_amp",
        f"stage{len(FLAGS)}_compile",
    ]


def test_every_step_holds_the_budget_padded_or_packed():
    plan = st.plan_steps(
        random_docs(50, 32), n_steps=12, tokens_per_step=100, max_length=32, seed=1
    )
    assert [sum(len(d) for d in step) for step in plan.steps] == [100] * 12
    padded = st.StepBatches(plan, packed=False, pad_id=0, attention_block_size=None)
    packed = st.StepBatches(plan, packed=True, pad_id=0, attention_block_size=None)
    for i in range(len(plan.steps)):
        a, b = padded[i], packed[i]
        assert a.input_ids.shape[1] == 32 and b.input_ids.shape == (plan.rows_packed, 32)
        assert int(a.lengths.sum()) == b.n_real_tokens == 100
        assert sorted(a.labels[a.labels >= 0].tolist()) == sorted(b.labels[b.labels >= 0].tolist())


def test_padded_and_packed_first_step_losses_agree_in_fp32():
    max_length = 32
    plan = st.plan_steps(random_docs(40, max_length), 1, 160, max_length, seed=0)
    cfg = GPTLikeConfig(
        vocab_size=97, d_model=32, n_heads=4, d_ff=64, dropout=0.0, max_length=max_length
    )
    device = torch.device("cpu")
    losses = []
    for stage in (st.stages()[0], dataclasses.replace(st.stages()[2], amp=False)):
        parts, batches = small_stage(cfg, stage, device, plan, seed=3, workers=0)
        losses.append(st.train_step(batches, parts)[0])
    assert losses[0].dtype == torch.float32
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_quick_run_writes_one_record_per_stage(tmp_path):
    out, traces = tmp_path / "out", tmp_path / "traces"
    study.main(["--quick", "--out", str(out), "--trace-dir", str(traces),
                "--cache", str(tmp_path / "cache")])  # fmt: skip
    records = read_records(out / study.LOG)
    assert [r["variant"] for r in records] == [st.stage_name(i) for i in range(len(FLAGS) + 1)]
    *trained, compiled = records
    assert compiled["metrics"]["skipped"].startswith("compile stage skipped on the CPU")
    for r in trained:
        m = r["metrics"]
        assert r["config"]["fixes"] == FLAGS[: r["config"]["stage"]]
        assert len(m["loss_curve"]) == study.QUICK.steps
        assert np.isfinite(m["loss_curve"]).all() and m["tokens_per_s"] > 0
        assert m["peak_mem_gib"] is None  # no allocator statistics on the CPU: not measured
        assert m["breakdown"]["device"] is None and m["breakdown"]["host"]["forward"] > 0
        with gzip.open(m["trace"], "rt") as f:
            assert json.load(f)["traceEvents"]
    # packing removes most of the padding the BRAIN stages train on
    pads = [r["metrics"]["padding_fraction"] for r in trained]
    assert max(pads[2:]) < min(pads[:2])


def test_blocks_cover_the_interleaved_steps_with_a_timed_step_each():
    for steps in range(2, 60):
        for block in (1, 2, 8):
            sizes = st.block_sizes(steps, block)
            assert sum(sizes) == steps and min(sizes) >= 2
            assert max(sizes) - min(sizes) <= 1
    assert st.block_sizes(136, 8) == [10] * 1 + [9] * 14


@pytest.mark.gpu
def test_only_the_stages_before_no_empty_cache_free_and_malloc_every_step():
    """The planted empty_cache: in a warm step of the stage before ``no_empty_cache`` the
    allocator returns its blocks to the driver (cudaFree) and takes them again (cudaMalloc);
    in the fixed stage a warm step calls neither."""
    device = torch.device("cuda")
    max_length = 32
    plan = st.plan_steps(random_docs(40, max_length), 3, 160, max_length, seed=0)
    # logits of 160 tokens x 4096 in fp32: 2.5 MiB, blocks of their own (not in the small
    # pool's shared 2 MiB segments, which stay while the weights live in them)
    cfg = GPTLikeConfig(
        vocab_size=4096, d_model=64, n_heads=4, d_ff=128, dropout=0.0, max_length=max_length
    )
    index = FLAGS.index("no_empty_cache") + 1
    calls = []
    for stage in st.stages()[index - 1 : index + 1]:
        parts, batches = small_stage(cfg, stage, device, plan, seed=0, workers=1)
        st.train_step(batches, parts)
        st.train_step(batches, parts)  # warm: optimizer state and cached blocks exist
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        st.train_step(batches, parts)
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        calls.append([after[k] - before[k] for k in ("num_device_free", "num_device_alloc")])
    assert min(calls[0]) > 0 and calls[1] == [0, 0]
