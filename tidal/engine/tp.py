"""Megatron-style tensor-parallel building blocks (torch.distributed only).

Two autograd primitives carry all of TP's communication:

    copy_to_tp:     forward identity,   backward all-reduce(sum)   (input of a column-parallel layer)
    reduce_from_tp: forward all-reduce, backward identity          (output of a row-parallel layer)

so each TP rank computes the same downstream loss and receives exactly the gradient of its own shard.
With `group=None` (TP 1) both are no-ops and the layers are plain `nn.Linear`/`nn.Embedding` math, which is
why the same module is the single-process reference in tests.

Weights are created from *global* tensors and sliced (`ParamSpec.tp_slices`), so every TP size starts from the
same model. Vocab splits may be uneven (floor split), heads must divide by TP (checked by the config).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tidal.engine.layout import split


def group_size(group) -> int:
    """Ranks in the TP `group` (None: no tensor parallelism, one rank)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    """This rank's index in the TP `group` (None: 0)."""
    return 0 if group is None else dist.get_rank(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W[rows of this rank]^T (+ b[rows of this rank]); output stays sharded along the feature dim."""

    def __init__(self, in_features: int, out_features: int, group=None, dtype=torch.float32, device=None,
                 bias: bool = False):
        super().__init__()
        self.group = group
        lo, hi = split(out_features, group_size(group), group_rank(group))
        self.weight = nn.Parameter(torch.empty(hi - lo, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(hi - lo, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local @ W[:, cols of this rank]^T; input arrives sharded, output is full."""

    def __init__(self, in_features: int, out_features: int, group=None, dtype=torch.float32, device=None):
        super().__init__()
        self.group = group
        lo, hi = split(in_features, group_size(group), group_rank(group))
        self.weight = nn.Parameter(torch.empty(out_features, hi - lo, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(torch.nn.functional.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds the rows of a vocab range; out-of-range ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, dim: int, group=None, dtype=torch.float32, device=None):
        super().__init__()
        self.group = group
        self.vocab_lo, self.vocab_hi = split(vocab_size, group_size(group), group_rank(group))
        self.weight = nn.Parameter(torch.empty(self.vocab_hi - self.vocab_lo, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.group) == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        inside = (ids >= self.vocab_lo) & (ids < self.vocab_hi)
        local = torch.where(inside, ids - self.vocab_lo, torch.zeros_like(ids))
        out = torch.nn.functional.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(out, self.group)


def vocab_parallel_logprobs(logits_local: torch.Tensor, targets: torch.Tensor, group, vocab_lo: int,
                            with_entropy: bool = False):
    """log softmax(logits)[target] for logits sharded along the last dim (vocab), in fp32; with `with_entropy`
    also the distribution's entropy per position (no grad): (log-probs, entropy).

    logits_local: [..., V_local] of the vocab range starting at `vocab_lo`; targets: [...] global ids.
    The max shift is a constant for the gradient and is taken without grad. Entropy = log Z - sum(e^s s) / Z
    over the shifted logits s (Z = sum e^s), each sum reduced over the TP group.
    """
    logits = logits_local.float()
    with torch.no_grad():
        m = logits.max(dim=-1).values
        if group_size(group) > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tp(exp.sum(dim=-1), group)
    v_local = logits.shape[-1]
    inside = (targets >= vocab_lo) & (targets < vocab_lo + v_local)
    local_t = torch.where(inside, targets - vocab_lo, torch.zeros_like(targets))
    picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside.to(shifted.dtype)
    target_logit = reduce_from_tp(picked, group)
    logprobs = target_logit - sum_exp.log()
    if not with_entropy:
        return logprobs
    with torch.no_grad():
        weighted = reduce_from_tp((exp * shifted).sum(dim=-1), group)
        entropy = sum_exp.log() - weighted / sum_exp
    return logprobs, entropy


def gather_vocab(logits_local: torch.Tensor, group, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits from vocab shards (for sampling); uneven shards allowed."""
    n = group_size(group)
    if n == 1:
        return logits_local
    sizes = [split(vocab_size, n, r) for r in range(n)]
    width = max(hi - lo for lo, hi in sizes)  # pad to equal shards: NCCL all_gather needs equal sizes
    pad = width - logits_local.shape[-1]
    mine = torch.nn.functional.pad(logits_local, (0, pad)) if pad else logits_local.contiguous()
    parts = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(parts, mine, group=group)
    return torch.cat([p[..., : hi - lo] for p, (lo, hi) in zip(parts, sizes)], dim=-1)
