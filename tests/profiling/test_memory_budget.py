"""memory_budget / host_budget against byte counts worked out by hand, and the planner's search."""

from __future__ import annotations

import pytest

from effdl.models.gpt2 import GPT2_LARGE_PARAMS, SHAPES
from effdl.profiling.memory_budget import (
    ESTIMATE_HEADROOM_GIB,
    fewest_checkpointed_blocks,
    host_budget,
    memory_budget,
)

GIB = 2**30
LARGE = SHAPES["large"]  # 36 layers, d = 1280, vocab 50257


def test_gpu_budget_by_hand() -> None:
    # tiny: 2 layers, d = 64; micro-batch 2 x 64 tokens, 36 d bytes per token per block
    b = memory_budget(SHAPES["tiny"], 3_382_080, 2, 64, 0, "gpu")
    assert b["working_weights"] == 3_382_080 * 2 / GIB
    assert b["grad_accumulation_fp32"] == 3_382_080 * 4 / GIB
    assert b["activations"] == 128 * 2 * 36 * 64 / GIB
    # 1024 fp32 + bf16 logits rows; the head's fp32 grad, bf16 and fp32 GEMM temporaries
    assert b["loss_chunk"] == (1024 * 50257 * 6 + 50257 * 64 * 10) / GIB
    assert b["total"] == pytest.approx(sum(v for k, v in b.items() if k != "total"), rel=1e-12)


def test_checkpointed_blocks_keep_their_input_plus_one_live_block() -> None:
    tokens, d = 4 * 1024, LARGE.n_embd
    b = memory_budget(LARGE, GPT2_LARGE_PARAMS, 4, 1024, 12, "cpu")
    assert b["grad_accumulation_fp32"] == 0  # "cpu" mode accumulates on the host
    assert b["activations"] * GIB == tokens * (24 * 36 * d + 12 * 2 * d + 36 * d)


def test_measured_activation_bytes_replace_the_count() -> None:
    b = memory_budget(LARGE, GPT2_LARGE_PARAMS, 1, 1024, 0, "gpu", act_bytes_per_token_layer=1000)
    assert b["activations"] * GIB == 1024 * 36 * 1000


@pytest.mark.parametrize(("mode", "stage_bytes"), [("gpu", 2), ("cpu", 4)])
def test_host_budget_bytes_per_param(mode: str, stage_bytes: int) -> None:
    h = host_budget(GPT2_LARGE_PARAMS, mode)
    # fp32 master, two moments and gradients; bf16 weight stage (and grad stage in "cpu" mode)
    assert h["total"] * GIB == pytest.approx(GPT2_LARGE_PARAMS * (16 + stage_bytes), rel=1e-12)
    assert h["grad_stage"] == (0 if mode == "gpu" else GPT2_LARGE_PARAMS * 2 / GIB)


def fits(n: int, cap: float) -> bool:
    est = memory_budget(LARGE, GPT2_LARGE_PARAMS, 4, 1024, n, "gpu")
    return est["total"] + ESTIMATE_HEADROOM_GIB <= cap


@pytest.mark.parametrize("cap", [7.0, 11.0, 12.0])
def test_fewest_checkpointed_blocks_is_the_first_that_fits(cap: float) -> None:
    n = fewest_checkpointed_blocks(LARGE, GPT2_LARGE_PARAMS, 4, 1024, "gpu", cap)
    assert n is not None and 0 < n < LARGE.n_layer
    assert fits(n, cap) and not fits(n - 1, cap)


def test_fewest_checkpointed_blocks_edges() -> None:
    args = (LARGE, GPT2_LARGE_PARAMS, 4, 1024, "gpu")
    assert fewest_checkpointed_blocks(*args, cap_gib=1000.0) == 0
    assert fewest_checkpointed_blocks(*args, cap_gib=1.0) is None  # weights alone exceed it


def test_none_counts_no_accumulator_and_unknown_modes_are_refused() -> None:
    none = memory_budget(LARGE, GPT2_LARGE_PARAMS, 4, 1024, 12, "none")
    gpu = memory_budget(LARGE, GPT2_LARGE_PARAMS, 4, 1024, 12, "gpu")
    assert none["grad_accumulation_fp32"] == 0
    assert gpu["total"] - none["total"] == pytest.approx(GPT2_LARGE_PARAMS * 4 / GIB)
    with pytest.raises(ValueError, match="grad_accumulation"):
        memory_budget(LARGE, GPT2_LARGE_PARAMS, 4, 1024, 12, "host")
