"""megatron-core's process groups for an actor layout on any subset of the world, without its global parallel_state.

megatron-core 0.16.1 takes explicit groups through `ProcessGroupCollection` (megatron/core/process_groups_config.py):
`GPTModel(..., pg_collection=)` hands them to every layer (embedding, attention, MLP, output layer, RoPE);
`DistributedDataParallel(..., pg_collection=)` and `get_megatron_optimizer(..., pg_collection=,
use_gloo_process_groups=False)` read dp / dp_cp / expt_dp / tp / pp / ep / mp / tp_ep_pp / intra_dist_opt from it
(`setup_process_groups_for_ddp`, `setup_process_groups_for_optimizer`) and set the optimizer's `tp_group` (grad
norm: TP duplicates counted once) and `grad_stats_parallel_group` (= intra_dist_opt: the norm's all-reduce). With
these, a forward, backward, DDP reduce-scatter and DistributedOptimizer step run with parallel_state never
initialized, and call none of its group / rank / size getters (a profiler over parallel_state.py in
tests/test_megatron_backend.py: only the memory buffer and `is_initialized`, below). For layout (tp, dp, devices)
on this rank (t, d)::

    tp, mp, tp_cp, tp_ep_pp, expt_tp   the layout's TP group of DP index d (PP = CP = EP = 1)
    dp, dp_cp, expt_dp, intra_dp_cp,   the layout's DP group of TP index t (no experts: expt_dp is never used for
      intra_expt_dp                    a collective, but DDP and the optimizer require the field)
    intra_dist_opt, tp_dp_cp           all of the layout's ranks (the grad norm is summed over them)
    pp, cp, ep                         this rank alone
    embd, pos_embd                     None (PP = 1: LanguageModule returns before touching them)

The TP / DP / layout groups are `GroupCache`'s (tidal/engine/groups.py: created once per rank set, collectively
over the world, shared with the native actor's rule); groups of one rank are `single[rank]`, made once per
`MegatronGroups` for every world rank in rank order (collective, so ranks stay in step; torch names groups by a
counter, so one-rank groups must be made world-wide too).

What megatron-core 0.16.1 still reads from process-global state, and what we do about it (each confined here):

- optimizer/__init__.py:180-181 (`_get_param_groups`): `all_gather_object` over the *world* to align the
  param-group keys. Ours: `layout_gather` (below).
- transformer/dot_product_attention.py:189 (attention scores): `parallel_state.get_global_memory_buffer()`; and
  tensor_parallel/random.py's RNG tracker (`get_cuda_rng_tracker().fork()`). Ours: `init_process_state`.
- transformer/utils.py:171 (`make_sharded_object_for_checkpoint`: the global TP / DP ranks), :202
  (`ensure_metadata_has_dp_cp_group`: the global DP group) and dist_checkpointing's save / load collectives (the
  world group). Ours: checkpoints only at a layout that is the whole world in order (`parallel_state_for`).

`layout_gather(layout_group, world)`: inside the block `torch.distributed.all_gather_object(out, obj)` without a group
gathers over the layout's group and answers the ranks outside the layout as an empty key list, which is what a
rank with no parameters contributes there; every layout rank has the same model, so the aligned keys are the ones
a world-wide gather would give. The global memory buffer is a process-local scratch allocator (no groups); the RNG
tracker is seeded per TP rank on CUDA (`model_parallel_cuda_manual_seed(seed, tp_rank=t)`) and is megatron's
inference tracker on CPU (megatron_cpu.py: no dropout).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.errors import LayoutError
from tidal.engine.backends import megatron_cpu as mc
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout


class MegatronGroups:
    """A `GroupCache` plus one-rank groups for every world rank (collective over the world: construct on every
    rank at the same point)."""

    def __init__(self, cache: GroupCache | None = None):
        self.cache = cache or GroupCache()
        self.single = [dist.new_group([r]) for r in range(dist.get_world_size())]

    def collection(self, layout: Layout, rank: int) -> Any | None:
        """This rank's `ProcessGroupCollection` for `layout` (collective over the world: the layout's groups are
        made on first use); None on ranks outside the layout."""
        mc.import_megatron()
        from megatron.core.process_groups_config import ProcessGroupCollection

        g = self.cache.get(layout)
        if not g.member:
            return None
        own = self.single[rank]
        tp, dp, everyone = g.tp or own, g.dp or own, g.all or own
        pgc = ProcessGroupCollection()
        for name in ("tp", "mp", "tp_cp", "tp_ep_pp", "expt_tp"):
            setattr(pgc, name, tp)
        for name in ("dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp"):
            setattr(pgc, name, dp)
        for name in ("pp", "cp", "ep"):
            setattr(pgc, name, own)
        pgc.intra_dist_opt = pgc.tp_dp_cp = everyone
        pgc.embd = pgc.pos_embd = None
        pgc.hcp = None
        return pgc


def init_process_state() -> None:
    """The process-local state megatron-core reads outside the groups (module doc): the global memory buffer and,
    without CUDA, the inference RNG tracker. Idempotent."""
    mc.import_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if ps._GLOBAL_MEMORY_BUFFER is None:
        ps._set_global_memory_buffer()
    if not torch.cuda.is_available():
        mrandom.initialize_rng_tracker(inference_rng_tracker=True)


@contextlib.contextmanager
def layout_gather(layout_group, world: int) -> Iterator[None]:
    """See the module doc (optimizer/__init__.py:181). `layout_group`: all of the layout's ranks."""
    real = dist.all_gather_object

    def gather(out: list, obj: Any, group=None) -> None:
        if group is not None:
            real(out, obj, group=group)
            return
        assert len(out) == world, (len(out), world)
        part: list = [None] * dist.get_world_size(layout_group)
        real(part, obj, group=layout_group)
        out[:] = part + [[] for _ in range(world - len(part))]

    dist.all_gather_object = gather  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_gather_object = real


def spans_world(layout: Layout) -> bool:
    """Whether `layout` is the whole world in rank order (what megatron-core's dist_checkpointing needs)."""
    return layout.devices == tuple(range(dist.get_world_size()))


def require_whole_world(layout: Layout) -> None:
    """LayoutError naming the fix unless `spans_world(layout)`."""
    world = dist.get_world_size()
    if not spans_world(layout):
        raise LayoutError("layout.devices", layout.devices, f"megatron-core's dist_checkpointing reads the global "
                          f"parallel_state, which spans the world of {world} ranks in order",
                          f"reshard to devices 0-{world - 1} before saving or loading a Megatron checkpoint")


@contextlib.contextmanager
def parallel_state_for(layout: Layout) -> Iterator[None]:
    """megatron-core's global parallel_state for `layout` for the duration of the block, for dist_checkpointing
    (module doc: its sharded objects and collectives read the global TP / DP ranks and the world group). Needs the
    layout to be the whole world in rank order; the process-local state is restored after."""
    require_whole_world(layout)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=1)
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        init_process_state()


__all__ = ["MegatronGroups", "init_process_state", "layout_gather", "parallel_state_for", "spans_world",
           "require_whole_world"]
