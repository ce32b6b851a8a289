"""Llama training FLOPs per token against torch's FlopCounterMode, and the BF16 peak table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from effdl.models.llama import (
    PRESETS,
    Transformer,
    build_on_meta,
    llama_matmul_params,
    llama_train_flops_per_token,
)
from effdl.profiling.flops import peak_bf16_tflops

CONFIGS = {
    "tiny": PRESETS["tiny"],
    "mha": dataclasses.replace(PRESETS["tiny"], n_kv_heads=None, ffn_dim_multiplier=1.3),
}


@pytest.mark.parametrize("name", [*PRESETS, "mha"])
def test_matmul_params_are_the_linear_weights(name):
    args = CONFIGS.get(name) or PRESETS[name]
    model = build_on_meta(args)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert llama_matmul_params(args) == linear


def counted_flops_per_token(args, backend: SDPBackend, batch: int, seq_len: int) -> float:
    """FlopCounterMode's count of one forward + backward, per token."""
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(backend), counter:
        model(tokens).sum().backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize("name", CONFIGS)
def test_formula_equals_flop_counter_on_the_math_attention(name):
    # The math path is plain batched GEMMs: every S x S score counted, forward and backward.
    args = CONFIGS[name]
    counted = counted_flops_per_token(args, SDPBackend.MATH, batch=2, seq_len=32)
    assert counted == llama_train_flops_per_token(args, 32, causal=False)


@pytest.mark.skipif(
    not any(str(op).endswith("_flash_attention_for_cpu_backward") for op in flop_registry),
    reason="this torch's FlopCounterMode has no formula for the CPU flash attention kernels",
)
def test_flash_backward_adds_the_score_recomputation():
    # Flash attention recomputes Q K^T in the backward (2·S·d per token and layer): FlopCounterMode
    # counts that kernel work, the model-FLOP formula does not.
    args, seq_len = CONFIGS["tiny"], 32
    counted = counted_flops_per_token(args, SDPBackend.FLASH_ATTENTION, batch=2, seq_len=seq_len)
    recompute = 2 * args.n_layers * args.dim * seq_len
    assert counted == llama_train_flops_per_token(args, seq_len, causal=False) + recompute


def test_causal_counts_half_the_attention_term_and_is_the_default():
    args = PRESETS["1b"]
    for seq_len in (2048, 4096):
        full = llama_train_flops_per_token(args, seq_len, causal=False)
        half = llama_train_flops_per_token(args, seq_len, causal=True)
        attention_half = 6 * args.n_layers * args.dim * seq_len
        assert full - half == half - 6 * llama_matmul_params(args) == attention_half
        assert llama_train_flops_per_token(args, seq_len) == half


@pytest.mark.parametrize(("tokens_per_s", "mfu_percent"), [(39.8e3, 31), (51.9e3, 41)])
def test_default_convention_reproduces_the_hf_baseline_mfu(tokens_per_s, mfu_percent):
    # Hugging Face LlamaForCausalLM, 1b shape, seq 2048, one H100, counted as 6N + 6·L·d·S.
    flops = llama_train_flops_per_token(PRESETS["1b"], 2048)
    mfu = tokens_per_s * flops / (peak_bf16_tflops("NVIDIA H100 80GB HBM3") * 1e12)
    assert round(100 * mfu) == mfu_percent


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_bf16_tflops_by_name(name, peak):
    assert peak_bf16_tflops(name) == peak
