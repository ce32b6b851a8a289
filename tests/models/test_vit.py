"""The ViT as given and fixed: shapes, parameter counts, and each attention variant against an
explicit reference on the same weights (float64)."""

from dataclasses import replace

import pytest
import torch

from effdl.models.vit import AS_GIVEN, FIXED, PRESETS, ViT, count_parameters, parameter_count

SMALL = replace(AS_GIVEN, image_size=64, patch_size=16, depth=2, dim=31, mlp_dim=33)


def model64(cfg, seed=0):
    torch.manual_seed(seed)
    return ViT(cfg).double().eval()


def images(n=3, size=64, seed=1):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)).double()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_map_224px_images_to_20_logits(name):
    model = ViT(PRESETS[name]).eval()
    assert model(torch.rand(2, 3, 224, 224)).shape == (2, 20)


@pytest.mark.parametrize(
    "cfg", [AS_GIVEN, FIXED, SMALL, replace(SMALL, fused_qkv=True, split_heads=True)]
)
def test_parameter_count_matches_the_closed_form(cfg):
    assert count_parameters(ViT(cfg)) == parameter_count(cfg)


def test_parameter_counts_of_the_presets():
    # 50 tokens of 32 x 32 x 3 = 3072 values; about 5.5 M parameters as given, +0.5% at dim 256
    assert (AS_GIVEN.num_patches + 1, AS_GIVEN.patch_dim) == (50, 3072)
    assert parameter_count(AS_GIVEN) == 5_517_710
    assert parameter_count(FIXED) == 5_545_492


def attention_reference(attn, x, heads):
    """Softmax attention computed head by head with explicit loops over the q, k, v weights."""
    cfg = attn.cfg
    q, k, v = (x @ lin.weight.T for lin in (attn.to_q, attn.to_k, attn.to_v))
    width = cfg.inner_dim // heads
    outs = []
    for h in range(heads):
        cols = slice(h * width, (h + 1) * width)
        scores = q[..., cols] @ k[..., cols].transpose(-1, -2) * cfg.dim_head**-0.5
        outs.append(torch.softmax(scores, dim=-1) @ v[..., cols])
    return attn.to_out(torch.cat(outs, dim=-1))


@pytest.mark.parametrize("split_heads", [False, True])
@pytest.mark.parametrize("sdpa", [False, True])
def test_attention_equals_the_explicit_reference(split_heads, sdpa):
    cfg = replace(SMALL, split_heads=split_heads, sdpa=sdpa)
    attn = model64(cfg).transformer.layers[0][0]
    x = torch.randn(2, 17, cfg.dim, dtype=torch.float64)
    heads = cfg.heads if split_heads else 1
    torch.testing.assert_close(attn(x), attention_reference(attn, x, heads), rtol=1e-10, atol=1e-10)


def test_sdpa_model_equals_the_softmax_model_on_the_same_weights():
    explicit = model64(replace(FIXED, sdpa=False))
    fused = model64(FIXED, seed=5)
    fused.load_state_dict(explicit.state_dict())
    x = images(size=224)
    torch.testing.assert_close(fused(x), explicit(x), rtol=1e-10, atol=1e-10)


def test_splitting_the_heads_changes_the_function():
    one_head = model64(SMALL)
    split = model64(replace(SMALL, split_heads=True), seed=5)
    split.load_state_dict(one_head.state_dict())
    x = images()
    assert (split(x) - one_head(x)).abs().max() > 1e-3


def test_fused_qkv_equals_three_linears_with_the_weights_stacked():
    separate = model64(SMALL)
    fused = model64(replace(SMALL, fused_qkv=True), seed=5)
    state = separate.state_dict()
    for i in range(SMALL.depth):
        pre = f"transformer.layers.{i}.0."
        state[pre + "to_qkv.weight"] = torch.cat(
            [state.pop(pre + f"to_{t}.weight") for t in "qkv"], dim=0
        )
    fused.load_state_dict(state)
    x = images()
    torch.testing.assert_close(fused(x), separate(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("cfg", "norm_used"), [(SMALL, False), (replace(SMALL, attn_prenorm=True), True)]
)
def test_forward_backward_reaches_every_parameter_but_the_unused_norm(cfg, norm_used):
    model = ViT(cfg).train()
    model(torch.rand(4, 3, 64, 64)).logsumexp(-1).sum().backward()
    unused = {
        name
        for name, p in model.named_parameters()
        if p.grad is None or not torch.isfinite(p.grad).all()
    }
    attn_norms = {
        f"transformer.layers.{i}.0.norm.{w}" for i in range(cfg.depth) for w in ("weight", "bias")
    }
    assert unused == (set() if norm_used else attn_norms)
