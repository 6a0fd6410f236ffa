"""Weights for a rollout rank, built from the actor's weights at any actor TP size.

The actor holds TP-local parameters keyed by `param_specs` names (`tidal/engine/layout.py`: TP rank t of tp holds
`split(dim, tp, t)` of each parameter's `tp_dim`). A rollout instance may run another TP size. The rollout
rank r of tp' needs `split(dim, tp', r)`, which overlaps one or more actor shards; we cut the overlapping
pieces and concatenate them along `tp_dim`::

    dim 10, actor tp=2:   [0 1 2 3 4 | 5 6 7 8 9]
    rollout tp=3, r=1:          [3 4 5 6]          = actor0[3:5] ++ actor1[0:2]

Replicated parameters (norms) come from any actor shard (TP rank 0). Pure function of tensors: the
transport (gather to the rollout ranks, or a reshard plan) belongs to the caller; passing the global weights
is the case actor tp=1. The engine then stamps them with a policy version (`NativeEngine.update_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tidal.core.errors import TidalError
from tidal.engine.layout import split
from tidal.engine.model import ModelArgs, check_tp, param_specs


def rollout_shard(args: ModelArgs, actor_shards: Sequence[Mapping[str, torch.Tensor]], rollout_tp: int,
                  rollout_rank: int) -> dict[str, torch.Tensor]:
    """This rollout rank's TP-local weights from the actor's per-TP-rank weights (`actor_shards[t]` = TP rank t;
    a one-element list holds global weights)."""
    actor_tp = len(actor_shards)
    if actor_tp < 1:
        raise TidalError("actor_shards", 0, "no actor weights given", "pass one dict per actor TP rank")
    check_tp(args, rollout_tp)
    if not 0 <= rollout_rank < rollout_tp:
        raise TidalError("rollout_rank", rollout_rank, f"outside [0, {rollout_tp})", "pass this rank's TP index")
    out: dict[str, torch.Tensor] = {}
    for spec in param_specs(args):
        for a, shard in enumerate(actor_shards):
            want = spec.tp_shape(actor_tp, a)
            got = shard.get(spec.name)
            if got is None:
                raise TidalError(f"actor_shards[{a}]", spec.name, "parameter missing", "send every param_specs name")
            if tuple(got.shape) != want:
                raise TidalError(f"actor_shards[{a}][{spec.name!r}]", tuple(got.shape),
                                 f"is not actor TP rank {a}/{actor_tp}'s shard shape {want}",
                                 "pass the actor ranks' shards in TP-rank order")
        if spec.tp_dim is None:
            out[spec.name] = actor_shards[0][spec.name]
            continue
        lo, hi = split(spec.shape[spec.tp_dim], rollout_tp, rollout_rank)
        pieces = []
        for a, shard in enumerate(actor_shards):
            alo, ahi = split(spec.shape[spec.tp_dim], actor_tp, a)
            s, e = max(lo, alo), min(hi, ahi)
            if s < e:
                pieces.append(shard[spec.name].narrow(spec.tp_dim, s - alo, e - s))
        out[spec.name] = pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=spec.tp_dim)
    return out


def actor_shards_from_global(args: ModelArgs, weights: Mapping[str, torch.Tensor], tp: int
                             ) -> list[dict[str, torch.Tensor]]:
    """The per-TP-rank weights an actor of size `tp` holds (for tests and single-process tools)."""
    return [{s.name: weights[s.name][s.tp_slices(tp, t)].clone() for s in param_specs(args)} for t in range(tp)]
