"""The native engine behind the actor backend protocol: a thin adapter over `ActorShard`.

`ActorShard` already is the backend (TP model, ZeRO-1 AdamW, exact resharding); this adapter names its verbs as
the protocol does, packs its reshard inputs and checkpoint results as the protocol's records, and adds the
Megatron checkpoint verbs:

- `save_megatron(dir)`: the weights (compute dtype) of every TP shard, written once (DP replica 0), as
  megatron-core dist_checkpointing (tidal/engine/backends/megatron_ckpt.py): GPTModel at any TP loads it.
- `load_megatron(dir)`: this rank's TP shard of a dist_checkpointing checkpoint written at any layout, by
  megatron-core or by us, into the parameters *and* the fp32 master weights of the owned ZeRO ranges. This
  backend reads weights only (distributed-optimizer state a Megatron backend wrote next to them is not mapped to
  our ZeRO ranges), so by default the Adam moments and the step (LR schedule position) are reset;
  `reset_optimizer=False` keeps them (e.g. a round trip through Megatron format of the same weights). The
  returned `CheckpointLoad.optimizer` says which.

Both are collective over the world like every other verb.

`save_shard` (this rank's file of a run checkpoint, the records gathered, the manifest) is the native format's
writer for any backend: the Megatron backend writes through it too, from an `ActorShard` of its own state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal, cast

import torch

from tidal.engine.actor import ActorShard, ExportedWeights, IterReport
from tidal.engine.backends.megatron_ckpt import load_megatron, save_actor_megatron
from tidal.engine.backends.protocol import CheckpointLoad, ProgramInputs, register_backend
from tidal.engine.checkpoint import (
    CheckpointMeta,
    ShardRecord,
    gather_records,
    load_actor,
    make_manifest,
    write_manifest,
    write_shard,
)
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.model import Transformer
from tidal.engine.reshard import ReshardReport


def save_shard(shard: ActorShard, tmp: str | Path, meta: CheckpointMeta) -> ShardRecord | None:
    """Collective over the layout: this rank's shard file in `tmp`, every rank's record all-gathered (a rank that
    failed makes every rank raise), the manifest written by the layout's first device. None outside the layout."""
    if shard.state is None:
        return None
    mine, error = None, None
    try:
        mine = write_shard(shard, tmp)
    except Exception as e:  # reported through the all-gather so no peer waits for this rank
        error = e
    records = gather_records(shard, mine, error)
    if shard.rank == shard.layout.devices[0]:
        write_manifest(tmp, make_manifest(shard, meta, records))
    return mine


class NativeBackend:
    """`ActorShard` as an `ActorBackend`; `shard` stays reachable for code that needs the engine itself."""

    name = "native"
    build = "native"

    def __init__(self, *args, **kwargs):
        self.shard = ActorShard(*args, **kwargs)
        self.groups: GroupCache = self.shard.groups

    @property
    def layout(self) -> Layout:
        return self.shard.layout

    @property
    def member(self) -> bool:
        return self.shard.state is not None

    @property
    def coord(self) -> tuple[int, int] | None:
        return self.shard.coord

    @property
    def model(self) -> Transformer | None:
        return self.shard.model

    def inventory(self) -> tuple[ParamSpec, ...]:
        return self.shard.specs

    def train_iter(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> IterReport | None:
        return self.shard.train_iter(source, loss_fn, num_tokens_in_iter)

    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None, *, local: bool = False,
                old_layout: Layout | None = None, prepared=None) -> ReshardReport:
        return self.shard.reshard(new_layout, fault, local=local, old_layout=old_layout, prepared=prepared)

    def program_inputs(self) -> ProgramInputs:
        sh = self.shard
        return ProgramInputs(sh.specs, torch.empty((), dtype=sh.dtype).element_size(), sh.bucket_bytes)

    def sync_layout(self, layout: Layout | None) -> None:
        self.shard.sync_layout(layout)

    def export_weights(self) -> ExportedWeights | None:
        return self.shard.export_weights()

    def gather_replica(self) -> dict[str, torch.Tensor] | None:
        return self.shard.gather_replica()

    def offload(self, *, optimizer: bool, grad: bool, weight: bool) -> int:
        return self.shard.offload(optimizer=optimizer, grad=grad, weight=weight)

    def onload(self) -> int:
        return self.shard.onload()

    def held_bytes(self) -> int:
        return self.shard.held_bytes()

    def resident_bytes(self) -> int:
        return self.shard.resident_bytes()

    def save_checkpoint(self, tmp: str | Path, meta: CheckpointMeta) -> ShardRecord | None:
        return save_shard(self.shard, tmp, meta)

    def load_checkpoint(self, gen: str | Path, layout: Layout, ranks: tuple[int, ...] | None = None
                        ) -> CheckpointLoad:
        sh = self.shard
        m = load_actor(sh, gen, layout, ranks=ranks)
        st = sh.state
        return CheckpointLoad(st is not None, st.step if st else m.optimizer_step,
                              st.data_cursor if st else m.data_cursor, sh.held_bytes())

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path:
        return save_actor_megatron(self.shard, ckpt_dir, padded_vocab)

    @torch.no_grad()
    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> CheckpointLoad:
        """Weights only (module doc): distributed-optimizer state a Megatron checkpoint may hold is not read, so the
        record says `reset` (or `kept`)."""
        sh = self.shard
        coord = sh.coord
        local = load_megatron(ckpt_dir, sh.args, sh.layout.tp, coord[0] if coord else 0, torch.float32,
                              active=coord is not None)
        st = sh.state
        opt: Literal["reset", "kept"] = "reset" if reset_optimizer else "kept"
        if st is None:
            return CheckpointLoad(False, 0, 0, 0, opt, "megatron")
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
        return CheckpointLoad(True, st.step, st.data_cursor, sh.held_bytes(), opt, "megatron")


register_backend("native", NativeBackend)

__all__ = ["NativeBackend", "save_shard"]
