"""Resharding Megatron-layout weights between TP/DP layouts with Tidal's planner (weights only; first step).

The planner (tidal/engine/reshard) works on `ParamSpec`s: a global shape and one TP dim with floor splits. Megatron's
TP-local tensors fit that rule once the inventory is written in Megatron's terms:

    spec                                       global shape      TP dim   Megatron TP-local tensor
    embedding.word_embeddings.weight           [Vp, h]           0        rows Vp/tp * [t, t+1)   (padded vocab)
    decoder.layers.i.self_attention.linear_qkv [G(r+2)D, h]      0        whole kv groups (fused, contiguous)
    ...self_attention.linear_qkv.bias          [G(r+2)D]         0        same groups (qkv_bias)
    ...self_attention.{q,k}_layernorm.weight   [D]               None     replicated (qk_norm)
    decoder.layers.i.self_attention.linear_proj [h, HD]          1
    decoder.layers.i.mlp.linear_fc1#gate       [F, h]            0        first half of the local linear_fc1
    decoder.layers.i.mlp.linear_fc1#up         [F, h]            0        second half of the local linear_fc1
    decoder.layers.i.mlp.linear_fc2            [h, F]            1
    norms                                      [h]               None
    output_layer.weight                        [Vp, h]           0

Floor splits equal Megatron's even splits because Megatron requires divisibility (`check_megatron_tp`, and
Vp % tp == 0). The fused SwiGLU tensor is the one layout that is not a slice of a TP-independent global tensor
(`[gate_t; up_t]`), hence two specs viewing its halves. So `plan_reshard(old, new, megatron_specs(...))` is the
plan, its "param" moves are the transfers, and this module executes them on GPTModel-shaped TP-local tensors
(one batched send/recv per move, no bucketing: a correctness path, not the fast one in tidal/engine/reshard).

Not covered: megatron-core's DistributedOptimizer state (fp32 main params and Adam moments in flat, bucketed
buffer shards: CUDA only), so a Megatron *actor* does not reshard yet; see docs/megatron.md.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from tidal.core.errors import LayoutError
from tidal.engine.backends.megatron_map import QK_NORMS, QKV_BIAS, QKVShape, check_megatron_tp
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.model import ModelArgs
from tidal.engine.reshard import ReshardPlan, plan_reshard
from tidal.engine.reshard.plan import shard_box

FC1 = "mlp.linear_fc1.weight"


def megatron_specs(args: ModelArgs, padded_vocab: int) -> tuple[ParamSpec, ...]:
    """The reshard inventory of GPTModel's weights (module names; fc1 as two half specs)."""
    h, f, hd, qs = args.hidden_size, args.intermediate_size, args.num_heads * args.head_dim, QKVShape.of(args)
    out = [ParamSpec("embedding.word_embeddings.weight", (padded_vocab, h), 0)]
    for i in range(args.num_layers):
        m = f"decoder.layers.{i}."
        rows = qs.groups * qs.rows_per_group
        out += [ParamSpec(m + "input_layernorm.weight", (h,), None),
                ParamSpec(m + "self_attention.linear_qkv.weight", (rows, h), 0)]
        if args.qkv_bias:
            out.append(ParamSpec(m + QKV_BIAS, (rows,), 0))
        if args.qk_norm:
            out += [ParamSpec(m + mod, (qs.head_dim,), None) for mod in QK_NORMS.values()]
        out += [ParamSpec(m + "self_attention.linear_proj.weight", (h, hd), 1),
                ParamSpec(m + "pre_mlp_layernorm.weight", (h,), None),
                ParamSpec(m + FC1 + "#gate", (f, h), 0),
                ParamSpec(m + FC1 + "#up", (f, h), 0),
                ParamSpec(m + "mlp.linear_fc2.weight", (h, f), 1)]
    out.append(ParamSpec("decoder.final_layernorm.weight", (h,), None))
    if not args.tie_embeddings:
        out.append(ParamSpec("output_layer.weight", (padded_vocab, h), 0))
    return tuple(out)


def check_layout(args: ModelArgs, padded_vocab: int, layout: Layout) -> None:
    check_megatron_tp(args, layout.tp)
    if padded_vocab % layout.tp:
        raise LayoutError("tp", layout.tp, f"does not divide the padded vocab {padded_vocab}",
                          "pad the vocab to a multiple of make_vocab_size_divisible_by * tp")


def _view(state: dict[str, torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """The TP-local tensor of `spec` inside GPTModel-shaped TP-local weights (fc1 halves are views)."""
    name, _, half = spec.name.partition("#")
    w = state[name]
    if not half:
        return w
    n = w.shape[0] // 2
    return w[:n] if half == "gate" else w[n:]


def _local(spec: ParamSpec, tp: int, t: int, box) -> tuple[slice, ...]:
    origin = shard_box(spec, tp, t)
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin))


def empty_shards(args: ModelArgs, padded_vocab: int, tp: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """GPTModel-shaped TP-local tensors of TP size tp (any t: the shapes are equal), uninitialized."""
    out = {}
    for spec in megatron_specs(args, padded_vocab):
        name, _, half = spec.name.partition("#")
        shape = spec.tp_shape(tp, 0)
        if half:
            shape = (2 * shape[0], *shape[1:])
            if half == "up":
                continue
        out[name] = torch.empty(shape, dtype=dtype)
    return out


def reshard_megatron_weights(state: dict[str, torch.Tensor] | None, args: ModelArgs, padded_vocab: int, old: Layout,
                             new: Layout, rank: int) -> tuple[dict[str, torch.Tensor] | None, ReshardPlan]:
    """Move GPTModel TP-local weights from layout `old` to `new` (collective over the world; `state` is None on
    ranks outside `old`). Returns this rank's new TP-local weights (None outside `new`) and the plan."""
    check_layout(args, padded_vocab, old)
    check_layout(args, padded_vocab, new)
    specs = megatron_specs(args, padded_vocab)
    plan = plan_reshard(old, new, specs)
    here_new = new.coord(rank)
    here_old = old.coord(rank)
    out = empty_shards(args, padded_vocab, new.tp, next(iter(state.values())).dtype if state else torch.float32) \
        if here_new is not None else None
    dtype = next(iter(out.values())).dtype if out else None
    ops, unpack = [], []
    for mv in plan.moves:
        if mv.what != "param":
            continue
        spec = specs[mv.spec]
        if mv.src == rank:  # a source is in `old` (state and here_old set), a destination in `new`
            state, here_old = cast(dict[str, torch.Tensor], state), cast("tuple[int, int]", here_old)
            src = _view(state, spec)[_local(spec, old.tp, here_old[0], mv.box)]
            if mv.dst == rank:
                out, here_new = cast(dict[str, torch.Tensor], out), cast("tuple[int, int]", here_new)
                _view(out, spec)[_local(spec, new.tp, here_new[0], mv.box)].copy_(src)
            else:
                ops.append(dist.P2POp(dist.isend, src.contiguous(), mv.dst))
        elif mv.dst == rank:
            buf = torch.empty([hi - lo for lo, hi in mv.box], dtype=dtype)
            ops.append(dist.P2POp(dist.irecv, buf, mv.src))
            unpack.append((spec, mv.box, buf))
    for w in dist.batch_isend_irecv(ops) if ops else []:
        w.wait()
    for spec, box, buf in unpack:  # received: this rank is in `new`
        out, here_new = cast(dict[str, torch.Tensor], out), cast("tuple[int, int]", here_new)
        _view(out, spec)[_local(spec, new.tp, here_new[0], box)].copy_(buf)
    return out, plan


__all__ = ["megatron_specs", "check_layout", "empty_shards", "reshard_megatron_weights"]
