"""The "megatron" actor backend: megatron-core's GPTModel + DDP + DistributedOptimizer behind `ActorBackend`.

One `MegatronBackend` per world rank, constructed like `ActorShard` (args, OptimConfig, layout, rank, seed,
device, dtype, weights=...) on every world rank; the layout may be any subset of the world's ranks (e.g. devices
2-5 of 6), ranks outside it hold nothing and return None from `train_iter` / `export_weights`. A rank of the
layout holds one `megatron_stack.Stack`: the layout's process groups, GPTModel, DDP and DistributedOptimizer
(what each is built with, and why, is that module's doc). LR and weight decay are set on every param group before
each step from our OptimConfig: `lr_at(hp, step)` (warmup + cosine, as ActorShard) and hp.weight_decay on *all*
parameters (megatron-core would exempt norms; ActorShard does not).

`train_iter(source, loss_fn, num_tokens_in_iter)` claims micro-batches from the same `MicrobatchSource` as
ActorShard (TP ranks of a DP group agree on the index), calls `loss_fn(self.model, mb, num_tokens_in_iter)` and
backpropagates it; `self.model` is a `GPTAdapter` with our model's `token_logprobs(ids_BT)` (fp32 log-probs of the
real vocab: the padded columns are masked out of the softmax), so loss functions written for our Transformer
(`nll_loss`, GRPO's) run unchanged. Then one DDP grad sync and one optimizer step; returns an `IterReport`.

`reshard(new_layout)`: plan / execute / commit of the full state (params, fp32 main params, exp_avg, exp_avg_sq,
step) through tidal/engine/backends/megatron_state_reshard.py, to any layout over any device set (collective over
the world). The new stack (its groups, GPTModel, DDP, optimizer) is built first on the new layout's ranks, the
ranges of both layouts are all-gathered over the world, the moves run, two world votes commit; on a failure the
old stack stays as it was (no global state to restore) and ReshardError is raised.

`save_megatron` / `load_megatron`: weights and distributed-optimizer state (fp32 main params, Adam moments, step)
through megatron-core's dist_checkpointing (megatron_state_ckpt.py), readable at any (tp, dp); a weights-only
checkpoint loads with the moments reset (or kept) and `CheckpointLoad.optimizer` says which. dist_checkpointing
reads the global parallel_state: they need the layout to be the whole world in rank order
(`megatron_groups.parallel_state_for`).

In the pipeline (tidal/workers/roles.py, through the protocol's verbs; conversions in megatron_convert.py):

    export_weights / gather_replica   the engines' names, TP split and compute dtype: the layout's TP shards are
                                      all-gathered (Megatron splits every tensor evenly, so the pieces are equal)
                                      to GPTModel's global weights, `from_megatron` unfuses QKV and [gate; up] and
                                      drops the padded vocab rows, then our TP shard t is cut (TP 1: no gather)
    save_checkpoint / load_checkpoint the native run-checkpoint format (tidal/engine/checkpoint.py), so a run
                                      resumes on either backend: the full state (params, fp32 main params, Adam
                                      moments, step, data cursor) is gathered over the layout in global terms,
                                      converted to our names and written through an `ActorShard` of the same
                                      layout; a load reads it into an `ActorShard` at the target layout (the native
                                      loader's resharding) and sets this backend's state from its global view.
                                      Costs one full fp32 copy of the state per layout rank while it runs. When the
                                      layout spans the world, the generation also holds `megatron/`: the same
                                      state through `save_megatron`; a load at a world-wide layout reads that copy
                                      (`CheckpointLoad.source` "megatron"), any other load the native shards
    program_inputs                    None: the moves are planned on the ranks (`megatron_state_reshard`)
    offload / onload                  the stack's optimizer state, grad and param buffers to host memory and back,
                                      bit for bit (`Stack.offload`)
    held_bytes / resident_bytes       DDP's param and grad buffers, fp32 main params and moments on this rank

CPU: megatron-core's DDP and optimizer run on gloo inside `megatron_cpu.optimizer_shim()` (its table lists the
sites). GPU: every shim is a no-op; megatron's CUDA RNG tracker is seeded per TP rank
(`model_parallel_cuda_manual_seed(seed, tp_rank=t)`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from tidal.core.errors import ConfigError, LayoutError, TrainingError
from tidal.engine.actor import ActorShard, ExportedWeights, IterReport, check_local_reshard, claim_microbatch
from tidal.engine.backends import megatron_cpu as mc
from tidal.engine.backends.megatron_convert import fill_shard, fill_views, gather_ours, ours_from_state
from tidal.engine.backends.megatron_groups import MegatronGroups, require_whole_world, spans_world
from tidal.engine.backends.megatron_map import choose_layer_spec, padded_vocab_size, te_importable
from tidal.engine.backends.megatron_reshard import check_layout, megatron_specs
from tidal.engine.backends.megatron_stack import GPTAdapter, Stack
from tidal.engine.backends.megatron_state_ckpt import StateLoad, load_state, save_state
from tidal.engine.backends.megatron_state_reshard import (
    StateViews,
    execute_state,
    gather_ranges,
    plan_state,
)
from tidal.engine.backends.native import save_shard
from tidal.engine.backends.protocol import CheckpointLoad, register_backend
from tidal.engine.checkpoint import CheckpointError, CheckpointMeta, ShardRecord, load_actor, read_manifest
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout, ParamSpec, synced_layout
from tidal.engine.model import ModelArgs, init_global_weights, param_specs
from tidal.engine.optim import OptimConfig, ShardState, lr_at
from tidal.engine.reshard import ReshardError, ReshardPlan, ReshardReport

log = logging.getLogger("tidal.megatron")

#: the run-checkpoint generation's subfolder holding the megatron-format copy of the state
MEGATRON_DIR = "megatron"


class MegatronBackend:
    """See the module doc. Construct on every world rank (collective)."""

    name = "megatron"

    def __init__(self, args: ModelArgs, hp: OptimConfig, layout: Layout, rank: int, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None, *,
                 weights: dict[str, torch.Tensor] | Literal["empty"] | None = None, padded_vocab: int | None = None,
                 groups: GroupCache | None = None, activation_checkpointing: bool = False,
                 transformer_engine: bool | Literal["auto"] = "auto"):
        """`weights`: our global weights; None: `init_global_weights(args, seed)`; "empty": GPTModel's params as
        built (a state set later, e.g. by a checkpoint load). `activation_checkpointing` is not wired to
        megatron-core's recompute here, so True is refused (the config refuses it first).
        `transformer_engine` (`actor.megatron_transformer_engine`): megatron-core's TE layer spec (True), its local
        spec (False), or TE where `transformer_engine` imports ("auto"); True without it is a ConfigError. What
        was chosen is `layer_spec` (logged once by rank 0)."""
        if activation_checkpointing:
            raise ConfigError("actor.activation_checkpointing", True, "is not supported by the megatron actor "
                              "backend", "set actor.activation_checkpointing: false or actor.backend: native")
        self.args, self.hp, self.rank, self.seed = args, hp, rank, seed
        self.layer_spec = choose_layer_spec(transformer_engine, te_importable())
        self.build = f"megatron, {self.layer_spec} layer spec"
        if rank == 0:
            log.info("megatron actor: layer spec %s", self.layer_spec)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # one padded size for every layout (it is part of the global shape the planner moves): Megatron-LM's
        # rule at TP 1 (a multiple of 128, divisible by every TP size up to 128)
        self.padded_vocab = padded_vocab or padded_vocab_size(args.vocab_size, 1)
        self.specs = megatron_specs(args, self.padded_vocab)
        check_layout(self.args, self.padded_vocab, layout)
        self.groups = groups or GroupCache()   # the layouts' TP / DP / all-ranks groups, as ActorShard's
        self._pgs = MegatronGroups(self.groups)
        self.step, self.data_cursor = 0, 0
        self._phases: dict[str, float] = {}   # the last forward_backward's compute and sync seconds
        if layout.coord(rank) is not None and weights is None:
            weights = init_global_weights(args, seed)
        self.stack = self._build(layout, None if weights == "empty" else weights)
        self.layout = layout

    def _build(self, layout: Layout, weights: dict[str, torch.Tensor] | Literal["empty"] | None) -> Stack | None:
        """The stack of `layout` on this rank (collective over the world: the layout's groups); None outside it."""
        pgc = self._pgs.collection(layout, self.rank)
        if pgc is None:
            return None
        return Stack(self.args, self.hp, layout, self.rank, self.padded_vocab, self.dtype, self.device, self.seed,
                     None if weights == "empty" else weights, pgc, self.layer_spec.transformer_engine)

    @property
    def member(self) -> bool:
        return self.stack is not None

    @property
    def coord(self) -> tuple[int, int] | None:
        return self.layout.coord(self.rank)

    def sync_layout(self, layout: Layout | None) -> None:
        """A rank outside the actor that sat out member-local reshards learns the current layout (it holds no
        state, so nothing moves)."""
        self.layout = synced_layout(self.layout, layout, self.stack is not None, self.rank)

    @property
    def model(self) -> GPTAdapter | None:
        """The policy on this rank; None outside the layout or while its weights are offloaded."""
        return self.stack.adapter if self.stack is not None and "weight" not in self.offloaded else None

    def _stack(self) -> Stack:
        if self.stack is None:
            raise RuntimeError(f"rank {self.rank} is not in the megatron actor's layout {self.layout}")
        return self.stack

    def inventory(self) -> tuple[ParamSpec, ...]:
        return self.specs

    # ---- training ------------------------------------------------------------------------------------
    def forward_backward(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> tuple[float, int]:
        """Zero the grad buffer, run the iter's micro-batches, sync grads over DP (reduce-scatter: each rank's
        owned ranges of `param.main_grad` hold the DP sum). Returns (this rank's loss sum, micro-batches run)."""
        st = self._stack()
        t0 = time.perf_counter()
        st.ddp.zero_grad_buffer()
        st.opt.zero_grad()
        losses = []
        while (item := claim_microbatch(source, self.layout, (st.t, st.d), st.tp_group, self.device)) is not None:
            loss = loss_fn(st.adapter, item[1], num_tokens_in_iter)
            loss.backward()
            losses.append(loss.detach().double())
        t1 = time.perf_counter()
        with mc.optimizer_shim():
            st.ddp.finish_grad_sync()
            if st.tp_group is not None and self.args.qk_norm:
                # q/k_layernorm weights are TP-replicated but each rank normalizes only its own heads: sum their
                # grads over TP, as Megatron-LM's finalize_model_grads does (ours: RMSNorm(grad_group=tp))
                from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
                _allreduce_non_tensor_model_parallel_grads([st.ddp], st.cfg, st.tp_group)
        self._phases = {"compute": t1 - t0, "sync": time.perf_counter() - t1}
        return float(torch.stack(losses).sum()) if losses else 0.0, len(losses)

    def train_iter(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> IterReport | None:
        """One optimizer step over the iter's queue (collective over the layout). None on ranks outside it."""
        if self.stack is None:
            return None
        self._require_resident("train_iter")
        start = time.perf_counter()
        st = self.stack
        loss, n = self.forward_backward(source, loss_fn, num_tokens_in_iter)
        t_update = time.perf_counter()
        lr = lr_at(self.hp, self.step)
        for dopt in st.dopts:
            for group in dopt.optimizer.param_groups:
                group["lr"], group["weight_decay"] = lr, self.hp.weight_decay
        with mc.optimizer_shim():
            ok, grad_norm, _ = st.opt.step()
        if not ok or not torch.isfinite(torch.tensor(grad_norm)) or not torch.isfinite(torch.tensor(loss)):
            # megatron-core's optimizer has applied the update when the norm is non-finite without a loss scaler:
            # the run stops here (the config refuses actor.on_nonfinite: skip with this backend)
            raise TrainingError("actor.on_nonfinite", self.hp.on_nonfinite, f"optimizer step {self.step} has "
                                f"gradient norm {grad_norm} and loss {loss} on rank {self.rank} (megatron backend)",
                                "resume from the last good checkpoint with a lower actor.lr or actor.grad_clip")
        self.step += 1
        self.data_cursor += len(source) if hasattr(source, "__len__") else 0
        loss_t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        if st.dp_group is not None:
            dist.all_reduce(loss_t, group=st.dp_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # the distributed optimizer's step also all-gathers the new params over DP: "update" holds the publish
        phases = {**self._phases, "update": time.perf_counter() - t_update}
        return IterReport(float(loss_t.item()), float(grad_norm), lr, float(grad_norm) > self.hp.grad_clip, n,
                          time.perf_counter() - start, phases)

    # ---- resharding ----------------------------------------------------------------------------------
    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None, *, local: bool = False,
                old_layout: Layout | None = None, prepared: Any = None) -> ReshardReport:
        """Move the full state to `new_layout` (collective over the world); see module doc.

        `local=True`: only the ranks of the old or the new layout call this, and its collectives run over the group
        of those ranks (`GroupCache.union`); every group it needs must exist already (`reshard_rank_sets`, made by
        `groups.ensure` or an earlier world-wide reshard), else LayoutError and nothing moves, as `ActorShard`'s.
        `old_layout`: the layout as the caller knows it (a rank that sat out local reshards catches up first).
        `prepared` (the native executor's programs) is not used: the plan is made here."""
        check_layout(self.args, self.padded_vocab, new_layout)
        self._require_resident("reshard")
        self.sync_layout(old_layout)
        if local:
            check_local_reshard(self.groups, self.layout, new_layout, self.rank)
        # the collectives' group: the world, or the ranks of either layout (a one-rank union: that rank's own)
        group = (self.groups.union(self.layout, new_layout) or self._pgs.single[self.rank]) if local else None
        report = ReshardReport(self.layout, new_layout, ok=False)
        t0 = time.perf_counter()
        phase = _Phases(fault)
        phase("plan")
        new, old_views, new_views, ranges = self._prepare(new_layout, group)
        phase("allocate")
        plan = None
        try:
            plan = plan_state(self.layout, new_layout, self.specs, *ranges)
        except Exception as e:
            phase.error = phase.error or f"plan: {type(e).__name__}: {e}"
        if _vote(phase.error is None, self.device, group):
            p_bytes = torch.empty((), dtype=self.dtype).element_size()
            plan = cast(ReshardPlan, plan)  # every rank planned (no error)
            report.bytes_moved = plan.bytes_moved(p_bytes)
            report.bytes_sent, report.bytes_received = execute_state(
                plan, old_views, new_views, self.rank, self.dtype, self.device)
            phase("transfer")
            phase("commit")
        ok = _vote(phase.error is None, self.device, group)
        report.seconds = time.perf_counter() - t0
        if not ok:  # the old stack is untouched (no global state to restore); the new one is dropped
            report.error = phase.error or "another rank voted to abort"
            raise ReshardError(report)
        self.stack, self.layout = new, new_layout
        report.ok = True
        return report

    def _prepare(self, new_layout: Layout, group) -> tuple[Stack | None, StateViews | None, StateViews | None,
                                                           tuple[dict, dict]]:
        """A reshard's inputs, over `group`: step and data cursor agreed, the new stack built (its groups made
        world-wide on first use), both layouts' views on this rank and both layouts' owned ranges of every rank."""
        # step and data cursor advance on the layout's ranks only: the old layout's first rank tells the others
        scalars = torch.tensor([self.step, self.data_cursor], dtype=torch.int64, device=self.device)
        dist.broadcast(scalars, src=self.layout.devices[0], group=group)
        self.step, self.data_cursor = (int(v) for v in scalars.tolist())
        old_views = self.stack.views(self.specs, self.step) if self.stack is not None else None
        old_ranges = gather_ranges(old_views.ranges() if old_views is not None else None, len(self.specs),
                                   self.device, group)
        new = self._build(new_layout, None)
        new_views = None
        if new is not None:
            new.set_step(self.step)
            new_views = new.views(self.specs, self.step)
        new_ranges = gather_ranges(new_views.ranges() if new_views is not None else None, len(self.specs),
                                   self.device, group)
        return new, old_views, new_views, (old_ranges, new_ranges)

    # ---- views -------------------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict_global(self, over_layout: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor in global Megatron coordinates on every rank (collective over the world, or with
        `over_layout` over the layout's ranks only, where the others return {}): param/<spec> (as fp32),
        master|exp_avg|exp_avg_sq/<spec>, step (owned ranges summed from their single owner; ranks outside the
        layout add zeros)."""
        if over_layout and self.stack is None:
            return {}
        with self._resident():
            return self._state_dict_global(over_layout)

    def _state_dict_global(self, over_layout: bool) -> dict[str, torch.Tensor]:
        group = self.groups.get(self.layout).all if over_layout else None
        reduce = not over_layout or group is not None   # a one-rank layout holds everything itself
        keys = [(i, k) for i in range(len(self.specs)) for k in ("param", "master", "exp_avg", "exp_avg_sq")]
        sizes = [self.specs[i].numel for i, _ in keys]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        fulls = [part.view(self.specs[i].shape) for part, (i, _) in zip(flat.split(sizes), keys)]
        if self.stack is not None:
            self.stack.fill_global(self.specs, self.step, keys, fulls)
        if reduce:
            dist.all_reduce(flat, group=group)  # each element has exactly one non-zero contributor: the sum is exact
        out = {f"{k}/{self.specs[i].name}": full for (i, k), full in zip(keys, fulls)}
        out["step"] = torch.tensor(self.step if self.stack is not None else 0)
        if reduce:
            dist.all_reduce(out["step"], op=dist.ReduceOp.MAX, group=group)  # layout ranks hold it (others lag)
        return out

    def export_megatron(self) -> ExportedWeights | None:
        """TP-local weights in GPTModel terms (specs = `inventory()`; fc1 halves are views); None outside the
        layout."""
        if self.stack is None:
            return None
        views = self.stack.views(self.specs, self.step)
        return ExportedWeights(self.layout.tp, self.stack.t, self.specs,
                               {s.name: p for s, p in zip(self.specs, views.params)})

    @torch.no_grad()
    def gather_replica(self) -> dict[str, torch.Tensor] | None:
        """Our global weights (the engines' names, compute dtype, on this device; new tensors, never views of the
        actor's) on every rank of the layout: the TP shards of this rank's DP replica all-gathered over its TP
        group (collective over the layout), unfused and with the padded vocab rows dropped (`from_megatron`). None
        outside the layout."""
        if self.stack is None:
            return None
        with self._resident():
            return self._gather_replica(self.stack)

    def _gather_replica(self, st: Stack) -> dict[str, torch.Tensor]:
        return gather_ours(st.views(self.specs, self.step), st.tp_group, self.args)

    def export_weights(self) -> ExportedWeights | None:
        """TP shard t of our weights (`param_specs` names and split, compute dtype) for the weight sync: cut from
        `gather_replica` (collective over the layout at TP > 1). None outside the layout."""
        whole = self.gather_replica()
        if whole is None:
            return None
        tp, t = self.layout.tp, cast(Stack, self.stack).t
        specs = tuple(param_specs(self.args))
        return ExportedWeights(tp, t, specs, {s.name: whole[s.name][s.tp_slices(tp, t)] for s in specs})

    def program_inputs(self) -> None:
        """None: the driver prepares no program; `reshard` plans the moves on the ranks."""
        return None

    # ---- memory (devices shared with generation) ----------------------------------------------------
    @property
    def offloaded(self) -> set[str]:
        """What `offload` moved off the device ("optimizer", "grad", "weight") until `onload`."""
        return self.stack.offloaded if self.stack is not None else set()

    def offload(self, *, optimizer: bool, grad: bool, weight: bool) -> int:
        """Hand the device to generation (`Stack.offload`); returns the bytes that left it. A no-op outside the
        layout or for what is off already; until `onload` this rank neither trains nor reshards."""
        if self.stack is None:
            return 0
        return self.stack.offload(optimizer, grad, weight, self.step)

    def onload(self) -> int:
        """Back on the device what `offload` moved, bit for bit (the grad buffers zeroed); returns the bytes."""
        if self.stack is None:
            return 0
        return self.stack.onload(self.step)

    @contextmanager
    def _resident(self) -> Iterator[None]:
        """The state on the device for a read (a checkpoint, an export while the engines generate), then handed
        back as it was: the device holds it again meanwhile."""
        flags = set(self.offloaded)
        if flags:
            self.onload()
        try:
            yield
        finally:
            if flags:
                self.offload(optimizer="optimizer" in flags, grad="grad" in flags, weight="weight" in flags)

    def _require_resident(self, op: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"megatron actor rank {self.rank}: {op} while {sorted(self.offloaded)} are offloaded "
                               "(onload first)")

    def held_bytes(self) -> int:
        """DDP's param and grad buffers, fp32 main params and Adam moments of this rank, wherever they are."""
        return self.stack.held_bytes(self.step) if self.stack is not None else 0

    def resident_bytes(self) -> int:
        """What of `held_bytes` is on the device (what `offload` leaves)."""
        return self.stack.resident_bytes(self.step) if self.stack is not None else 0

    # ---- run checkpoints (the native format) --------------------------------------------------------
    @torch.no_grad()
    def _global_ours(self, over_layout: bool) -> dict[str, dict[str, torch.Tensor]]:
        """kind -> our global tensors (fp32) of this backend's state, kinds "param" and OPT_KINDS."""
        return ours_from_state(self.state_dict_global(over_layout=over_layout), self.specs, self.args)

    def _native_twin(self, layout: Layout) -> ActorShard:
        """An `ActorShard` at `layout` on this rank, its state unset (collective over the world only for a layout
        whose groups are new)."""
        return ActorShard(self.args, self.hp, layout, self.rank, self.seed, self.device, self.dtype,
                          groups=self.groups, weights="empty")

    def save_checkpoint(self, tmp: str | Path, meta: CheckpointMeta) -> ShardRecord | None:
        """This rank's shard of a run checkpoint in the native format and, when the layout spans the world, the
        same state in megatron-core's format under `<tmp>/megatron/` (module doc; collective over the layout)."""
        if self.stack is None:
            return None
        ours = self._global_ours(over_layout=True)
        twin = self._native_twin(self.layout)
        try:
            st = cast(ShardState, twin.state)
            st.step, st.data_cursor = self.step, self.data_cursor
            fill_shard(twin, ours)
            record = save_shard(twin, tmp, meta)
        finally:
            twin.free()
        if spans_world(self.layout):
            self._save_state(Path(tmp) / MEGATRON_DIR)
        elif self.rank == self.layout.devices[0]:
            log.info("run checkpoint %s: no megatron-format copy (layout %s is not the whole world of %d ranks in "
                     "order, which megatron-core's dist_checkpointing needs); the native shards hold the full state",
                     tmp, self.layout, dist.get_world_size())
        return record

    def load_checkpoint(self, gen: str | Path, layout: Layout, ranks: tuple[int, ...] | None = None
                        ) -> CheckpointLoad:
        """Every world rank: this backend's state from a run-checkpoint generation at `layout` (module doc): its
        megatron-format copy when it has one and `layout` spans the world, else its native shards. A failed read
        leaves every rank's state as it was (a vote) and raises. Its groups span the whole world: `ranks` (a world
        that lost ranks) is refused."""
        if ranks is not None:
            raise NotImplementedError("the megatron backend loads over the whole world only; a world that lost "
                                      "ranks restarts with new workers (TrainingRun.restart)")
        check_layout(self.args, self.padded_vocab, layout)
        copy = Path(gen) / MEGATRON_DIR
        if spans_world(layout) and (copy / "metadata.json").is_file():
            m = read_manifest(gen)   # the marker and the manifest: the generation is complete
            loaded = self._load_state(copy, layout, reset_optimizer=True)
            if loaded.optimizer != "checkpoint":
                raise CheckpointError("checkpoint", str(copy), "holds weights without the optimizer state a run "
                                      "checkpoint's megatron copy always has", f"remove {copy} to load the native "
                                      "shards, or resume from another generation")
            if self.data_cursor != m.data_cursor or self.step != m.optimizer_step:
                raise CheckpointError("checkpoint", str(copy), f"is at step {self.step}, data cursor "
                                      f"{self.data_cursor}; the manifest says {m.optimizer_step}, {m.data_cursor}",
                                      f"remove {copy} to load the native shards")
            return loaded
        self.onload()   # the loaded state is built on the device, as the native actor's
        twin = self._native_twin(self.layout)
        try:
            m = load_actor(twin, gen, layout)
            g = twin.state_dict_global()   # collective over the world
        finally:
            twin.free()
        if layout != self.layout or self.stack is None:   # built with grad mode on: DDP hooks its grad accumulators
            self.stack = self._build(layout, None)
            self.layout = layout
        self.step, self.data_cursor = int(g["step"]), int(g["data_cursor"])
        if self.stack is not None:
            self._set_state(g)
        return CheckpointLoad(self.stack is not None, self.step if self.stack else m.optimizer_step,
                              self.data_cursor if self.stack else m.data_cursor, self.held_bytes())

    @torch.no_grad()
    def _set_state(self, g: dict[str, torch.Tensor]) -> None:
        """This rank's params, main params and moments from our global tensors `g` (keys kind/<name>)."""
        st = cast(Stack, self.stack)
        st.set_step(self.step)
        fill_views(st.views(self.specs, self.step), g, self.args, self.padded_vocab)

    def grads(self) -> dict[str, torch.Tensor]:
        """TP-local fp32 grads after `forward_backward` (module names; at DP > 1 only owned ranges are summed)."""
        return {name: p.main_grad for name, p in self._stack().params.items()}

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path:
        """Weights and distributed-optimizer state (fp32 main params, Adam moments, step) through megatron-core's
        dist_checkpointing, Megatron-LM's keys (tidal/engine/backends/megatron_state_ckpt.py). Collective over the
        world; the layout must span it."""
        if padded_vocab not in (None, self.padded_vocab):
            raise LayoutError("padded_vocab", padded_vocab, f"the megatron backend's model is padded to "
                              f"{self.padded_vocab}", "omit padded_vocab")
        require_whole_world(self.layout)
        return self._save_state(Path(ckpt_dir))

    def _save_state(self, path: Path) -> Path:
        st = self._stack()
        with self._resident():
            st.set_step(self.step)   # every param has its Adam state (megatron-core reads one step per param)
            return save_state(st, self.layout, path, self.step, self.data_cursor)

    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> CheckpointLoad:
        """Weights of a dist_checkpointing checkpoint (any writer layout, by megatron-core or by us) and, when it
        holds them, fp32 main params, Adam moments and step, at this backend's layout. A weights-only checkpoint
        resets the moments and step (`reset_optimizer`, the default) or keeps this actor's; the returned
        `optimizer` says which. Collective over the world; the layout must span it."""
        return self._load_state(Path(ckpt_dir), self.layout, reset_optimizer)

    def _load_state(self, path: Path, layout: Layout, reset_optimizer: bool) -> CheckpointLoad:
        """`load_megatron` at `layout`: read into a new stack, vote over the world, then adopt it (a failed read
        leaves every rank's state as it was)."""
        require_whole_world(layout)
        self.onload()
        # every rank is in a whole-world layout; built with grad mode on (DDP hooks its grad accumulators)
        new = cast(Stack, self._build(layout, None))
        with torch.no_grad():
            return self._adopt(new, path, layout, reset_optimizer)

    def _adopt(self, new: Stack, path: Path, layout: Layout, reset_optimizer: bool) -> CheckpointLoad:
        new.set_step(0)
        got, error = None, None
        try:
            got = load_state(new, layout, path, 0)
        except Exception as e:   # reported through the vote so no peer adopts a state this rank could not read
            error = e
        if not _vote(error is None, self.device):
            raise error or CheckpointError("checkpoint", str(path), "was not read by another rank (its error is "
                                           "on that rank)", "fix that rank's error and load again")
        got = cast(StateLoad, got)
        opt: Literal["checkpoint", "reset", "kept"] = "checkpoint"
        if got.optimizer:
            self.step = cast(int, got.optimizer_step)
            new.set_step(self.step)
        else:   # weights only: main params from the weights; moments zero (as built) or the actor's own
            for name, (lo, hi, main) in new.main.items():
                main.copy_(new.params[name].data.reshape(-1)[lo:hi].float())
            keep = not reset_optimizer and self.stack is not None and layout == self.layout
            if keep:
                old = cast(Stack, self.stack)
                for name in new.main:
                    for dst, src in zip(new.moments(name, self.step), old.moments(name, self.step)):
                        dst.copy_(src)
            self.step = self.step if keep else 0
            opt = "kept" if keep else "reset"
            new.set_step(self.step)
        if got.data_cursor is not None:
            self.data_cursor = got.data_cursor
        self.stack, self.layout = new, layout
        return CheckpointLoad(True, self.step, self.data_cursor, self.held_bytes(), opt, "megatron")


class _Phases:
    """A reshard's fault points (`fault(name)`, the tests' injection) and its first error: a phase's, or the
    planner's; the votes report it."""

    def __init__(self, fault: Callable[[str], None] | None):
        self.fault = fault
        self.error: str | None = None

    def __call__(self, name: str) -> None:
        if self.fault is not None and self.error is None:
            try:
                self.fault(name)
            except Exception as e:
                self.error = f"{name}: {type(e).__name__}: {e}"


def _vote(ok: bool, device, group=None) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


register_backend("megatron", MegatronBackend)

__all__ = ["MegatronBackend", "GPTAdapter"]
