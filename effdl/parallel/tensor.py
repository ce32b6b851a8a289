"""Tensor (intra-layer) parallelism on ``torch.distributed`` collectives (Megatron-LM, Shoeybi et
al. 2019; Narayanan et al. 2021, section 2.3).

Each rank of a process group holds a slice of every parallel layer's features. Four autograd-aware
collectives move activations between the replicated and the sharded view; the layers below use
them so that forward outputs and gradients equal those of the single-process module:

==========================  =========================  ========================
function                    forward                    backward
==========================  =========================  ========================
``copy_to_parallel``        identity                   all-reduce (sum)
``reduce_from_parallel``    all-reduce (sum)           identity
``gather_from_parallel``    all-gather (last dim)      keep this rank's slice
``split_to_parallel``       keep this rank's slice     all-gather (last dim)
==========================  =========================  ========================

Sharding is ``torch.chunk`` along the feature dimension: rank ``r`` holds chunk ``r``. Sharded
dimensions must divide evenly by the group's size (``torch.chunk`` would otherwise give ranks
unequal, or too few, chunks, and all-gather needs equal shapes).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import skip_init

Group = dist.ProcessGroup | None


def _world(group: Group) -> tuple[int, int]:
    """(this rank within ``group``, ``group``'s size); None is the default group."""
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of ``x`` over the group, in a new tensor (autograd's buffers are never written)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the last dimension, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


def _own_chunk(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    rank, world = _world(group)
    return x.chunk(world, dim=dim)[rank].contiguous()


class _CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _all_gather_last(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _own_chunk(grad, ctx.group), None


class _SplitToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return _own_chunk(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_last(grad, ctx.group), None


def copy_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """``x`` unchanged (replicated on every rank); backward sums the ranks' gradients, since each
    rank's sharded branch contributes part of ``x``'s gradient."""
    return _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum of the ranks' partial ``x``; backward passes the (replicated) gradient through."""
    return _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Ranks' last-dimension shards concatenated in rank order; backward keeps this rank's
    slice of the gradient."""
    return _GatherFromParallel.apply(x, group)


def split_to_parallel(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """This rank's ``torch.chunk`` of the replicated ``x`` along the last dimension; backward
    all-gathers the gradient slices."""
    return _SplitToParallel.apply(x, group)


def _shard_size(features: int, group: Group, what: str) -> int:
    world = dist.get_world_size(group)
    if features % world:
        raise ValueError(f"{what}={features} does not divide evenly across {world} ranks")
    return features // world


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), with the fan-in
    of the full layer rather than of this rank's shard."""
    bound = 1 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s rows (output features) split across ranks.

    Input: the full ``x`` (..., in_features), replicated. Output: this rank's shard
    (..., out_features / world) with ``gather_output=False``, else the full ``y`` gathered from
    all ranks. The layer's own initialisation draws shards independently; use
    :meth:`from_linear` to shard an existing ``nn.Linear`` exactly.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        group: Group = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        local = _shard_size(out_features, group, "out_features")
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(local, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(local, **kw)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: Group = None, gather_output: bool = True
    ) -> ColumnParallelLinear:
        """This rank's chunk of ``linear``'s weight rows and bias (copies; ``linear`` untouched;
        no random draws)."""
        w = linear.weight
        layer = skip_init(
            cls,
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            gather_output=gather_output,
            group=group,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(_own_chunk(w, group, dim=0))
            if linear.bias is not None:
                layer.bias.copy_(_own_chunk(linear.bias, group, dim=0))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_parallel(x, self.group), self.weight, self.bias)
        return gather_from_parallel(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W``'s columns (input features) split across ranks.

    Input: this rank's shard (..., in_features / world) with ``input_is_parallel=True``, else
    the full ``x``, of which the layer keeps its chunk. Each rank computes a partial product;
    one all-reduce sums them, and the full bias is added once, after the sum (it is replicated
    on every rank). Output: the full ``y``, replicated. Use :meth:`from_linear` to shard an
    existing ``nn.Linear`` exactly.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        group: Group = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        local = _shard_size(in_features, group, "in_features")
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, local, **kw))
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: Group = None, input_is_parallel: bool = False
    ) -> RowParallelLinear:
        """This rank's chunk of ``linear``'s weight columns and the full bias (copies)."""
        w = linear.weight
        layer = skip_init(
            cls,
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            group=group,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(_own_chunk(w, group, dim=1))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_to_parallel(x, self.group)
        y = reduce_from_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}"
        )


class ParallelMLP(nn.Module):
    """Megatron's MLP: ``ColumnParallelLinear -> activation -> RowParallelLinear``, with the
    hidden activations left sharded in between, so two dense layers cost one all-reduce in
    forward (after the row layer) and one in backward (of the input's gradient, before the
    column layer). The activation must act elementwise. Input and output: full, replicated.
    """

    def __init__(
        self,
        fc_in: ColumnParallelLinear,
        activation: nn.Module,
        fc_out: RowParallelLinear,
    ) -> None:
        super().__init__()
        if fc_in.gather_output or not fc_out.input_is_parallel:
            raise ValueError(
                "ParallelMLP needs fc_in with gather_output=False and fc_out with "
                "input_is_parallel=True (the hidden activations stay sharded)"
            )
        self.fc_in, self.activation, self.fc_out = fc_in, activation, fc_out

    @classmethod
    def from_linears(
        cls,
        fc_in: nn.Linear,
        activation: nn.Module,
        fc_out: nn.Linear,
        group: Group = None,
    ) -> ParallelMLP:
        """Shard a single-process ``fc_in -> activation -> fc_out`` (weights copied)."""
        return cls(
            ColumnParallelLinear.from_linear(fc_in, group, gather_output=False),
            activation,
            RowParallelLinear.from_linear(fc_out, group, input_is_parallel=True),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.activation(self.fc_in(x)))


class ParallelLayerNorm(nn.Module):
    """LayerNorm over a feature dimension that is sharded across ranks (e.g. between a column-
    and a row-parallel layer). Input and output: this rank's shard (..., features / world).

    The mean and variance need the full feature set, which no rank holds. Each rank computes
    its shard's mean ``m_r`` and sum of squared deviations ``M2_r`` per row (two passes over
    local data), one all-reduce hands every rank all of them (each rank fills its own slot of
    a zeroed ``(world, 2, rows)`` tensor; differentiable, its backward sums the gradients the
    same way), and every rank combines them as Chan et al. do: ``mean = mean_r(m_r)``,
    ``M2 = sum_r M2_r + (n / world) * sum_r (m_r - mean)**2``, ``var = M2 / n`` (biased, as
    nn.LayerNorm). Unlike ``E[x**2] - mean**2`` from all-reduced sums, no large terms cancel,
    so float32 keeps its precision when ``|mean|`` is large against the standard deviation,
    at the same one collective per direction. Affine weight and bias (as nn.LayerNorm's
    ``elementwise_affine`` and ``bias``) are sharded like the features.
    """

    def __init__(
        self,
        normalized_features: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        group: Group = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_features, self.eps, self.group = normalized_features, eps, group
        self.local_features = local = _shard_size(normalized_features, group, "normalized_features")
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(local, **kw)) if elementwise_affine else None
        has_bias = elementwise_affine and bias
        self.bias = nn.Parameter(torch.zeros(local, **kw)) if has_bias else None

    @classmethod
    def from_layer_norm(cls, norm: nn.LayerNorm, group: Group = None) -> ParallelLayerNorm:
        """This rank's chunk of a single-process LayerNorm over the last dimension (copies)."""
        if len(norm.normalized_shape) != 1:
            raise ValueError(
                f"only a LayerNorm over the last dimension can be sharded, got "
                f"normalized_shape={tuple(norm.normalized_shape)}"
            )
        ref = norm.weight if norm.weight is not None else torch.empty(0)
        layer = cls(
            norm.normalized_shape[0],
            eps=norm.eps,
            elementwise_affine=norm.weight is not None,
            bias=norm.bias is not None,
            group=group,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            for mine, full in ((layer.weight, norm.weight), (layer.bias, norm.bias)):
                if mine is not None and full is not None:
                    mine.copy_(_own_chunk(full, group))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.local_features:
            raise ValueError(
                f"x ends in {x.shape[-1]} features; this rank's shard of "
                f"{self.normalized_features} is {self.local_features}"
            )
        rank, world = _world(self.group)
        local_mean = x.mean(-1)
        local_m2 = (x - local_mean.unsqueeze(-1)).square().sum(-1)
        slots = [torch.zeros_like(local_mean)] * (2 * world)
        slots[2 * rank], slots[2 * rank + 1] = local_mean, local_m2
        padded = torch.stack(slots).unflatten(0, (world, 2))
        # Every rank's output depends on every rank's statistics: all-reduce forward and backward.
        shard_mean, shard_m2 = reduce_from_parallel(
            copy_to_parallel(padded, self.group), self.group
        ).unbind(1)
        mean = shard_mean.mean(0)
        m2 = shard_m2.sum(0) + x.shape[-1] * (shard_mean - mean).square().sum(0)
        var = m2 / self.normalized_features
        y = (x - mean.unsqueeze(-1)) * torch.rsqrt(var.unsqueeze(-1) + self.eps)
        if self.weight is not None:
            y = y * self.weight
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return f"normalized_features={self.normalized_features}, eps={self.eps}"


def _activation_module(activation: Callable | nn.Module) -> nn.Module:
    """nn.TransformerEncoderLayer keeps relu/gelu as functions; ParallelMLP takes a module."""
    if isinstance(activation, nn.Module):
        return activation
    known = {F.relu: nn.ReLU, F.gelu: nn.GELU}
    if activation not in known:
        raise ValueError(f"activation {activation!r} is not F.relu, F.gelu or an nn.Module")
    return known[activation]()


def _own_heads(packed: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's heads of a packed [q; k; v] projection (weight rows or bias): chunk ``r`` of
    each of q, k and v, concatenated."""
    return torch.cat([_own_chunk(part, group, dim=0) for part in packed.chunk(3, dim=0)])


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split across ranks: a column-parallel q/k/v
    projection (this rank's heads, output sharded), attention over the local heads, and a
    row-parallel output projection. One all-reduce in forward, one in backward. Input and
    output: the full (batch, seq, embed_dim), replicated. Build it with :meth:`from_attention`.
    """

    def __init__(
        self, qkv: ColumnParallelLinear, out_proj: RowParallelLinear, num_heads: int
    ) -> None:
        super().__init__()
        self.qkv, self.out_proj = qkv, out_proj
        self.local_heads = num_heads // dist.get_world_size(qkv.group)
        self.head_dim = out_proj.in_features // num_heads

    @classmethod
    def from_attention(
        cls, attention: nn.MultiheadAttention, group: Group = None
    ) -> ParallelSelfAttention:
        """This rank's heads of ``attention`` (copies; ``attention`` untouched)."""
        packed = attention.in_proj_weight is not None
        if (
            not (attention.batch_first and packed)
            or attention.dropout
            or attention.bias_k is not None
            or attention.add_zero_attn
        ):
            raise ValueError(
                "only batch-first self-attention (one packed q/k/v projection) without dropout, "
                "bias_k/bias_v or add_zero_attn can be split"
            )
        embed, heads = attention.embed_dim, attention.num_heads
        _shard_size(heads, group, "num_heads")
        w, b = attention.in_proj_weight, attention.in_proj_bias
        kw = {"group": group, "device": w.device, "dtype": w.dtype}
        qkv = skip_init(
            ColumnParallelLinear, embed, 3 * embed, bias=b is not None, gather_output=False, **kw
        )
        with torch.no_grad():
            qkv.weight.copy_(_own_heads(w, group))
            if b is not None:
                qkv.bias.copy_(_own_heads(b, group))
        out_proj = RowParallelLinear.from_linear(attention.out_proj, group, input_is_parallel=True)
        return cls(qkv, out_proj, heads)

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            t.view(batch, seq, self.local_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class ParallelTransformerBlock(nn.Module):
    """A Transformer encoder layer with its attention heads and MLP hidden units split across
    ranks (:class:`ParallelSelfAttention`, :class:`ParallelMLP`); the LayerNorms act on the
    replicated residual stream and are copied to every rank. Two all-reduces in forward and two
    in backward per block. Input and output: the full (batch, seq, d_model), replicated.
    Build it from ``nn.TransformerEncoderLayer`` with :meth:`from_encoder_layer`.
    """

    def __init__(
        self,
        self_attn: ParallelSelfAttention,
        mlp: ParallelMLP,
        norm1: nn.LayerNorm,
        norm2: nn.LayerNorm,
        norm_first: bool,
    ) -> None:
        super().__init__()
        self.self_attn, self.mlp, self.norm1, self.norm2 = self_attn, mlp, norm1, norm2
        self.norm_first = norm_first

    @classmethod
    def from_encoder_layer(
        cls, layer: nn.TransformerEncoderLayer, group: Group = None
    ) -> ParallelTransformerBlock:
        """Shard ``layer`` (batch-first, dropout 0: ranks would draw different masks for the
        replicated activations). ``layer`` is not modified; the norms are deep copies."""
        dropouts = (layer.dropout.p, layer.dropout1.p, layer.dropout2.p)
        if any(dropouts):
            raise ValueError(f"dropout must be 0 for tensor parallelism, got {dropouts}")
        mlp = ParallelMLP.from_linears(
            layer.linear1, _activation_module(layer.activation), layer.linear2, group
        )
        return cls(
            ParallelSelfAttention.from_attention(layer.self_attn, group),
            mlp,
            copy.deepcopy(layer.norm1),
            copy.deepcopy(layer.norm2),
            layer.norm_first,
        )

    def forward(self, x: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        if self.norm_first:
            x = x + self.self_attn(self.norm1(x), is_causal=is_causal)
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.self_attn(x, is_causal=is_causal))
        return self.norm2(x + self.mlp(x))
