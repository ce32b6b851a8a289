"""The Llama-3 model against Hugging Face's LlamaForCausalLM, its closed-form parameter count
against the built model, and its meta-device build and materialisation."""

from __future__ import annotations

import copy
import dataclasses
import math
import time

import pytest
import torch

from effdl.models.llama import (
    PRESETS,
    Transformer,
    TransformerModelArgs,
    build_on_meta,
    count_parameters,
    ffn_hidden_dim,
    hf_key,
    materialize,
    to_hf_config,
    to_hf_state_dict,
)

TINY = PRESETS["tiny"]
# Shapes beyond the presets: plain multi-head attention, a multiplier that truncates, one kv head.
ODD = {
    "mha": dataclasses.replace(TINY, n_kv_heads=None, ffn_dim_multiplier=1.3, multiple_of=48),
    "mqa": dataclasses.replace(TINY, dim=96, n_heads=6, n_kv_heads=1, vocab_size=333),
}
CONFIGS = {**PRESETS, **ODD}


@pytest.mark.parametrize(
    ("name", "hidden"), [("tiny", 192), ("125m", 2048), ("1b", 8192), ("8b", 14336)]
)
def test_ffn_hidden_dim_follows_metas_rule(name, hidden):
    assert ffn_hidden_dim(PRESETS[name]) == hidden


def test_ffn_hidden_dim_truncates_before_rounding_up():
    # int(2 * 4 * 64 / 3) = 170; int(1.3 * 170) = 221; next multiple of 48 is 240.
    assert ffn_hidden_dim(ODD["mha"]) == 240


@pytest.mark.parametrize("name", CONFIGS)
def test_closed_form_count_equals_the_built_model(name):
    args = CONFIGS[name]
    model = build_on_meta(args)
    assert count_parameters(args) == sum(p.numel() for p in model.parameters())


def test_seed_configuration_count_by_hand():
    d, kv, hidden, layers, vocab = 4096, 8 * 128, 14336, 32, 131072
    block = 2 * d * d + 2 * d * kv + 3 * d * hidden + 2 * d
    assert count_parameters(PRESETS["8b"]) == layers * block + 2 * vocab * d + d == 8_053_329_920


def test_8b_builds_on_meta_without_storage():
    build_on_meta(TINY)  # first build pays for lazy imports
    start = time.perf_counter()
    model = build_on_meta(PRESETS["8b"])
    assert time.perf_counter() - start < 2.0
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _hf_twin(args: TransformerModelArgs, ours: Transformer):
    from transformers import LlamaForCausalLM

    config = to_hf_config(args)
    config._attn_implementation = "eager"  # the explicit softmax(QK^T)V, not SDPA
    hf = LlamaForCausalLM(config)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict()))
    return hf


@pytest.mark.parametrize("kv_heads", [2, None])
def test_logits_and_gradients_equal_hugging_face(kv_heads):
    pytest.importorskip("transformers")
    args = dataclasses.replace(
        TINY, n_kv_heads=kv_heads, rope_theta=500000.0, ffn_dim_multiplier=1.3
    )
    torch.manual_seed(0)
    ours = Transformer(args)
    hf = _hf_twin(args, ours)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    weights = torch.randn(2, 16, args.vocab_size)

    logits = ours(tokens)
    hf_logits = hf(tokens).logits
    torch.testing.assert_close(logits, hf_logits, rtol=1e-5, atol=1e-5)

    (logits * weights).sum().backward()
    (hf_logits * weights).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        expected = hf_params[hf_key(name)].grad
        # float32 summation-order noise, relative to the tensor's largest entry
        scale = expected.abs().max().item()
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-6 * scale)


def test_later_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = Transformer(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_materialize_allocates_and_initialises_like_a_fresh_model(dtype):
    reference = Transformer(TINY)
    torch.manual_seed(3)
    reference.init_weights()

    model = build_on_meta(TINY)
    torch.manual_seed(3)
    assert materialize(model, "cpu", dtype) is model

    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.device.type == "cpu" and p.dtype == dtype, name
        torch.testing.assert_close(p, ref.to(dtype), msg=name)
    for name in ("rope_cos", "rope_sin"):
        table = getattr(model, name)
        assert table.dtype == torch.float32
        torch.testing.assert_close(table, getattr(reference, name), rtol=0, atol=0)
    assert torch.isfinite(model(torch.randint(0, TINY.vocab_size, (2, 8))).float()).all()


def test_init_scales():
    args = dataclasses.replace(TINY, dim=256, n_layers=8, n_heads=8, n_kv_heads=4)
    torch.manual_seed(0)
    model = Transformer(args)
    block = model.layers[3]
    residual = 0.02 / math.sqrt(2 * args.n_layers)
    expected = {
        "embedding": (model.tok_embeddings.weight, 0.02),
        "wq": (block.attention.wq.weight, 0.02),
        "w1": (block.feed_forward.w1.weight, 0.02),
        "wo": (block.attention.wo.weight, residual),
        "w2": (block.feed_forward.w2.weight, residual),
        "head": (model.output.weight, args.dim**-0.5),
    }
    for name, (weight, std) in expected.items():
        assert weight.std().item() == pytest.approx(std, rel=0.05), name
        assert abs(weight.mean().item()) < std / 10, name
    for norm in (block.attention_norm, block.ffn_norm, model.norm):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))


def test_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size must be set"):
        TransformerModelArgs()
    with pytest.raises(ValueError, match="not divisible by n_heads"):
        dataclasses.replace(TINY, dim=66)
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads"):
        dataclasses.replace(TINY, n_kv_heads=3)
    with pytest.raises(ValueError, match="even head dimension"):
        dataclasses.replace(TINY, dim=60, n_heads=4)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        Transformer(dataclasses.replace(TINY, seq_len=8))(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("name", ["norm_eps", "rope_theta", "ffn_dim_multiplier"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_or_non_finite_scalars_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
        dataclasses.replace(TINY, **{name: value})


@pytest.mark.gpu
def test_1b_forward_on_cuda_in_bf16():
    args = PRESETS["1b"]
    torch.manual_seed(0)
    model = materialize(build_on_meta(args), "cuda", torch.bfloat16)
    assert model.rope_cos.is_cuda and model.rope_cos.dtype == torch.float32
    tokens = torch.randint(0, args.vocab_size, (1, 128), device="cuda")
    with torch.no_grad():
        logits = model(tokens)
    assert logits.shape == (1, 128, args.vocab_size) and logits.dtype == torch.bfloat16
    assert torch.isfinite(logits).all()


def _attention_pass(attention, x, cos, sin, device, dtype):
    """Output, input gradient and ``wk`` gradient of a copy of ``attention`` on device/dtype."""
    attention = copy.deepcopy(attention).to(device, dtype)
    x = x.detach().to(device, dtype).requires_grad_()
    out = attention(x, cos.to(device), sin.to(device))
    out.backward(torch.ones_like(out))
    return [t.float().cpu() for t in (out, x.grad, attention.wk.weight.grad)]


@pytest.mark.gpu
def test_grouped_query_attention_on_cuda_matches_cpu_float32():
    # Whatever SDPA kernel CUDA picks for bf16 GQA must group the heads as the CPU reference does:
    # bf16 rounding is < 1% of the norm, a wrong grouping ~100%.
    args = dataclasses.replace(TINY, dim=512, n_heads=8, n_kv_heads=2, n_layers=1, seq_len=256)
    torch.manual_seed(0)
    model = Transformer(args)
    x = torch.randn(2, args.seq_len, args.dim)
    pass_args = (model.layers[0].attention, x, model.rope_cos, model.rope_sin)
    reference = _attention_pass(*pass_args, "cpu", torch.float32)
    on_cuda = _attention_pass(*pass_args, "cuda", torch.bfloat16)
    for name, got, want in zip(("output", "x.grad", "wk.grad"), on_cuda, reference, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 0.03, name
