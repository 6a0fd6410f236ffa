"""The Megatron actor's full state in megatron-core's own checkpoint format: weights *and* optimizer state.

`MegatronBackend.save_megatron(dir)` is one megatron-core `dist_checkpointing.save` (torch_dist format) of the
top-level keys Megatron-LM's own checkpoints use::

    model        GPTModel.sharded_state_dict(): the weights in the model's dtype (keys: megatron_ckpt.py)
    optimizer    DistributedOptimizer.sharded_state_dict(model, metadata={"distrib_optim_sharding_type":
                 "fully_reshardable"}):
                   optimizer.state.fp32_param.<model key>   fp32 main params  } global tensors in model space,
                   optimizer.state.exp_avg.<model key>      Adam moments      } sharded over TP like the weight
                   optimizer.state.exp_avg_sq.<model key>                     } (fused QKV, [gate; up], padded vocab)
                   optimizer.param_groups (common.pt)       hyper-parameters and `step` (torch AdamW's step)
    iteration    the optimizer step (Megatron-LM's key)
    tidal        {"optimizer_step", "data_cursor"}: where the actor's LR schedule and data stream stand

`load_state(stack, dir, ...)` reads it into a stack of *any* layout (tp, dp): megatron-core plans each rank's
regions from the global keys, so TP and DP both change on load. A checkpoint without `optimizer.state.*` keys
(written by `megatron_ckpt.save_megatron` or the native backend: weights only) loads its weights and leaves
the optimizer to the caller, which resets or keeps the moments and says which (`CheckpointLoad.optimizer`).

Why `fully_reshardable`: in megatron-core 0.16.1 it is the one distributed-optimizer format that reshards
over TP and DP. `fully_sharded_model_space` builds ShardedTensors with `flattened_range`, which 0.16.1's
`ShardedTensor.validate_metadata_integrity` refuses ("flattened_range is not supported"); `dp_reshardable`
stores the optimizer's bucket layout and reshards over DP only. Its cost: the save all-gathers each bucket's
state over DP (three fp32 copies of a TP rank's state per rank while it runs), and DP replica 0 writes.

Two sites of megatron-core 0.16.1's load break on the torch-optimizer path (no Apex / Transformer Engine:
`HAVE_APEX_OR_TE` False, as on this machine and the GPU machine); each fix is confined to `_torch_adam_load`:

    distrib_optimizer.py:940 `_set_main_param_and_optimizer_states`
        copies every key of the live param state, torch AdamW's `step` included, from the loaded tensors, which
        hold no `step` (it comes from param_groups): `KeyError: 'step'`.
        Ours: the live `step` is passed through as its own value (a copy onto itself).
    distrib_optimizer.py:819-825 `load_state_dict`
        sets *one* step tensor on every param's state; torch AdamW adds 1 to each param's step in place, so a
        shared one advances once per param per step (measured: step 16 after one step of a 15-param model).
        Ours: every param's state gets a tensor of its own after the load.

Both `save_state` and `load_state` are collective over the torch.distributed world and need megatron-core's
global parallel_state (`megatron_groups.parallel_state_for`: the layout must be the whole world in rank order).

    backend.save_megatron("ckpt/iter_0000004")                       # at tp=2, dp=1
    other.load_megatron("ckpt/iter_0000004")                         # at tp=1, dp=2: same moments, same step
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal.engine.backends import megatron_cpu as mc
from tidal.engine.backends.megatron_groups import parallel_state_for
from tidal.engine.layout import Layout

#: the distributed optimizer's checkpoint format (module doc: why this one)
SHARDING = "fully_reshardable"
OPT_PREFIX = "optimizer.state."


@dataclass(frozen=True)
class StateLoad:
    """What `load_state` found in a checkpoint."""

    optimizer: bool
    """The checkpoint held optimizer state and it was loaded (False: weights only; the moments are untouched)."""
    optimizer_step: int | None
    """The saved optimizer step (None without optimizer state)."""
    data_cursor: int | None
    """Micro-batches consumed, as saved by Tidal (None: not a Tidal checkpoint, or weights only)."""


def _metadata() -> dict:
    return {"distrib_optim_sharding_type": SHARDING}


def has_optimizer_state(ckpt_dir: str | Path) -> bool:
    """Whether a dist_checkpointing checkpoint holds distributed-optimizer state (reads its metadata only)."""
    from megatron.core import dist_checkpointing

    return any(k.startswith(OPT_PREFIX) for k in dist_checkpointing.load_tensors_metadata(str(ckpt_dir)))


def save_state(stack: Any, layout: Layout, ckpt_dir: str | Path, step: int, data_cursor: int) -> Path:
    """Weights and optimizer state of `stack` (a `megatron_stack.Stack` at `layout`, every param's Adam state
    present) into `ckpt_dir` (module doc). Collective over the world."""
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    path.mkdir(parents=True, exist_ok=True)
    with parallel_state_for(layout), mc.optimizer_shim():
        model = stack.model.sharded_state_dict()
        sd = {"model": model, "optimizer": stack.opt.sharded_state_dict(model, metadata=_metadata()),
              "iteration": step, "tidal": {"optimizer_step": step, "data_cursor": data_cursor}}
        dist_checkpointing.save(sd, str(path))
    return path


@torch.no_grad()
def load_state(stack: Any, layout: Layout, ckpt_dir: str | Path, step: int) -> StateLoad:
    """Weights (and, when the checkpoint has them, fp32 main params, Adam moments and step) from `ckpt_dir` into
    `stack`, a `megatron_stack.Stack` at `layout` whose params' Adam state exists at `step` (`set_step`).
    Collective over the world. Loads in place: call it on a stack that is not yet the actor's, so a failed read
    leaves the actor."""
    from megatron.core import dist_checkpointing

    with_opt = has_optimizer_state(ckpt_dir)
    with parallel_state_for(layout), mc.optimizer_shim():
        model = stack.model.sharded_state_dict()
        sd: dict = {"model": model}
        if with_opt:
            with _torch_adam_load(stack.dopts):   # building the load dict runs the optimizer's load_state_dict
                sd["optimizer"] = stack.opt.sharded_state_dict(model, is_loading=True, metadata=_metadata())
        loaded = dist_checkpointing.load(sd, str(ckpt_dir))
        stack.model.load_state_dict(loaded["model"], strict=False)
        if not with_opt:
            return StateLoad(False, None, None)
        with _torch_adam_load(stack.dopts):
            stack.opt.load_state_dict(loaded["optimizer"])
    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    tidal = common.get("tidal") or {}
    saved_step = tidal.get("optimizer_step", common.get("iteration"))
    if saved_step is None:   # a Megatron-LM checkpoint without `iteration`: torch AdamW's own step
        saved_step = next(float(s["step"]) for d in stack.dopts for s in d.optimizer.state.values())
    return StateLoad(True, int(saved_step), tidal.get("data_cursor"))


@contextmanager
def _torch_adam_load(dopts: list) -> Iterator[None]:
    """The two megatron-core 0.16.1 load sites of the module doc's table, for the distributed optimizers
    `dopts`: the live `step` passes through `_set_main_param_and_optimizer_states`, and every param's state
    owns its step tensor afterwards."""
    for dopt in dopts:
        setter = dopt._set_main_param_and_optimizer_states

        def keep_step(model_param, tensors, dopt=dopt, setter=setter):
            g, i = dopt.model_param_group_index_map[model_param]
            live = dopt.optimizer.state[dopt.optimizer.param_groups[g]["params"][i]]
            setter(model_param, {**{k: v for k, v in live.items() if k not in tensors}, **tensors})

        dopt._set_main_param_and_optimizer_states = keep_step   # an instance attribute: the class stays as it is
    try:
        yield
    finally:
        for dopt in dopts:
            del dopt._set_main_param_and_optimizer_states
            for state in dopt.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].detach().clone()


__all__ = ["SHARDING", "StateLoad", "has_optimizer_state", "save_state", "load_state"]
