"""The native engine behind the actor backend protocol: a thin adapter over `ActorShard`.

`ActorShard` already is the backend (TP model, ZeRO-1 AdamW, exact resharding); this adapter names its verbs as
the protocol does and adds the Megatron checkpoint verbs:

- `save_megatron(dir)`: the weights (compute dtype) of every TP shard, written once (DP replica 0), as
  megatron-core dist_checkpointing (tidal/engine/backends/megatron_ckpt.py): GPTModel at any TP loads it.
- `load_megatron(dir)`: this rank's TP shard of a dist_checkpointing checkpoint written at any layout, by
  megatron-core or by us, into the parameters *and* the fp32 master weights of the owned ZeRO ranges. A Megatron
  checkpoint here carries weights only, so by default the Adam moments and the step (LR schedule position) are
  reset; `reset_optimizer=False` keeps them (e.g. a round trip through Megatron format of the same weights).

Both are collective over the world like every other verb.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from tidal.engine.actor import ActorShard, ExportedWeights, IterReport
from tidal.engine.backends.megatron_ckpt import load_megatron, save_actor_megatron
from tidal.engine.backends.protocol import register_backend
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.reshard import ReshardReport


class NativeBackend:
    """`ActorShard` as an `ActorBackend`; `shard` stays reachable for code that needs the engine itself."""

    name = "native"

    def __init__(self, *args, **kwargs):
        self.shard = ActorShard(*args, **kwargs)

    @property
    def layout(self) -> Layout:
        return self.shard.layout

    def inventory(self) -> tuple[ParamSpec, ...]:
        return self.shard.specs

    def train_iter(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> IterReport | None:
        return self.shard.train_iter(source, loss_fn, num_tokens_in_iter)

    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None) -> ReshardReport:
        return self.shard.reshard(new_layout, fault)

    def export_weights(self) -> ExportedWeights | None:
        return self.shard.export_weights()

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path:
        return save_actor_megatron(self.shard, ckpt_dir, padded_vocab)

    @torch.no_grad()
    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> None:

        sh = self.shard
        coord = sh.coord
        local = load_megatron(ckpt_dir, sh.args, sh.layout.tp, coord[0] if coord else 0, torch.float32,
                              active=coord is not None)
        st = sh.state
        if st is None:
            return
        for i, spec in enumerate(sh.specs):
            flat = cast(dict, local)[spec.name].reshape(-1)  # a rank with a state was active: it loaded
            st.param(i).copy_(flat.view(st.param(i).shape))
            lo, hi = st.shape.owned[i]
            o = st.shape.opt_offsets[i]
            st.master[o:o + hi - lo].copy_(flat[lo:hi])
        if reset_optimizer:
            st.exp_avg.zero_()
            st.exp_avg_sq.zero_()
            st.step = 0


register_backend("native", NativeBackend)

__all__ = ["NativeBackend"]
