"""The Megatron actor's state in our terms and back: what the megatron backend's checkpoints and weight exports
convert, on top of the name and layout mapping of `megatron_map`.

Three spellings of one set of tensors::

    ours (`param_specs` names)
        | to_megatron ^ from_megatron          (fused QKV and [gate; up], padded vocab rows)
        v             |
    GPTModel module names
        | split_halves ^ join_halves           (fc1 as `#gate` / `#up` halves)
        v              |
    reshard specs (`megatron_reshard.megatron_specs`: each a TP-sliceable global tensor)

A state is keyed `kind/<name>` with kind "param" or one of `OPT_KINDS` (fp32 main params, Adam moments): each
kind converts like the weights (the moments of a fused tensor are fused the same way), so a state crosses between
the backends exactly (rows are moved, never recomputed). `fill_views` writes our global tensors into one rank's
Megatron state (its TP shard, its owned flat ranges), `fill_shard` into an `ActorShard`'s (its TP shard, its
ZeRO ranges); `gather_ours` all-gathers a DP replica's Megatron TP shards into our global weights.

`set_tp_attributes` marks GPTModel's TP-split weights as megatron-core's init would (see there).
"""
from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from tidal.engine.actor import ActorShard
from tidal.engine.backends.megatron_map import FC1, from_megatron, to_megatron
from tidal.engine.backends.megatron_reshard import megatron_specs
from tidal.engine.backends.megatron_state_reshard import StateViews
from tidal.engine.layout import ParamSpec
from tidal.engine.model import ModelArgs, param_specs
from tidal.engine.optim import OPT_KINDS, ShardState

#: the kinds of a full state: the weights, then the optimizer's (fp32 main params, exp_avg, exp_avg_sq)
STATE_KINDS = ("param",) + OPT_KINDS


def join_halves(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Spec-named tensors (fc1 as `#gate` / `#up` halves) -> GPTModel module names ([gate; up] rows)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        base, _, half = name.partition("#")
        if half == "up":
            continue
        out[base] = torch.cat([w, state[base + "#up"]]) if half == "gate" else w
    return out


def split_halves(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `join_halves`."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(FC1):
            out[name + "#gate"], out[name + "#up"] = w.chunk(2)
        else:
            out[name] = w
    return out


def ours_from_state(g: dict[str, torch.Tensor], specs: tuple[ParamSpec, ...], args: ModelArgs
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> our global tensors, from a Megatron state in global coordinates (`g`: keys kind/<spec name>)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for kind in STATE_KINDS:
        meg = {spec.name: g[f"{kind}/{spec.name}"] for spec in specs}
        out[kind] = from_megatron(join_halves(meg), args)
    return out


@torch.no_grad()
def fill_views(views: StateViews, g: dict[str, torch.Tensor], args: ModelArgs, padded_vocab: int) -> None:
    """One rank's Megatron state (`views`: params, main params and moments of its TP shard and owned ranges) from
    our global tensors `g` (keys kind/<name>)."""
    names = [s.name for s in param_specs(args)]
    meg = {kind: split_halves(to_megatron({n: g[f"{kind}/{n}"] for n in names}, args, padded_vocab))
           for kind in STATE_KINDS}
    tp, t = views.tp, views.t
    for i, spec in enumerate(views.specs):
        views.params[i].copy_(meg["param"][spec.name][spec.tp_slices(tp, t)])
        opt = views.opt[i]
        if opt is None:
            continue
        lo, hi, *bufs = opt
        for kind, buf in zip(OPT_KINDS, bufs):
            buf.copy_(meg[kind][spec.name][spec.tp_slices(tp, t)].reshape(-1)[lo:hi])


@torch.no_grad()
def fill_shard(shard: ActorShard, ours: dict[str, dict[str, torch.Tensor]]) -> None:
    """`shard`'s params (TP shard) and owned optimizer ranges from our global tensors per kind."""
    st = cast(ShardState, shard.state)
    t = cast("tuple[int, int]", shard.coord)[0]
    for i, spec in enumerate(shard.specs):
        local = {k: ours[k][spec.name][spec.tp_slices(shard.layout.tp, t)].reshape(-1) for k in ours}
        st.param(i).copy_(local["param"].view(st.param(i).shape))
        lo, hi = st.shape.owned[i]
        o = st.shape.opt_offsets[i]
        for kind in OPT_KINDS:
            st.buffer(kind)[o:o + hi - lo].copy_(local[kind][lo:hi])


@torch.no_grad()
def gather_ours(views: StateViews, tp_group, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our global weights (new tensors, never views of the actor's) from the TP shards of one DP replica
    (`views` of each of its ranks), all-gathered over its TP group (collective over it at TP > 1)."""
    full: dict[str, torch.Tensor] = {}
    for spec, local in zip(views.specs, views.params):
        if spec.tp_dim is not None and views.tp > 1:
            parts = [torch.empty_like(local) for _ in range(views.tp)]   # Megatron's splits are even
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            local = torch.cat(parts, dim=spec.tp_dim)
        else:   # a copy: the params are views of DDP's buffer, which `offload(weight=True)` frees
            local = local.clone()
        full[spec.name] = local
    return from_megatron(join_halves(full), args)


def set_tp_attributes(params: dict[str, nn.Parameter], args: ModelArgs, padded_vocab: int) -> None:
    """The `tensor_model_parallel` / `partition_dim` / `partition_stride` attributes megatron-core 0.16.1 sets on
    TP-split weights only inside its init functions, i.e. not with perform_initialization=False (linear biases do
    get them). The optimizer reads them (`param_is_not_tensor_parallel_duplicate`): without them every TP-split
    weight counts in the grad norm on TP rank 0 only, and clipping at TP > 1 uses a wrong norm. Set as megatron-core
    sets them with initialization (stride 2 for the fused SwiGLU fc1); replicated norms stay unmarked, as there."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    tp_dim = {s.name.partition("#")[0]: s.tp_dim for s in megatron_specs(args, padded_vocab)}
    for name, p in params.items():   # local-spec names
        if tp_dim[name] is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, tp_dim[name], 2 if name.endswith(FC1) else 1)
