"""Worker-side role functions of the RL pipeline: what a device does as actor, rollout or inference.

The driver (`tidal.pipeline`) calls these through `WorkerGroup.submit(device, roles.fn, ...)`, or the typed
methods of `tidal.workers.endpoints` (the worker resolves the function by its module path; no code travels); each
runs inside the device's worker process with its `WorkerContext`. One call runs at a time per worker, so a role
never races with itself. A worker's role state is one typed object, `WorkerRoles` (`roles_of(ctx)`), kept between
calls:

    run        RunSpec: model args, optimizer config, sampling, task, seeds (set once by `setup`)
    actor      ActorBackend (`actor.backend`: native or megatron, built by the registry; every worker has one:
               world-collective group creation and reshard votes; it holds memory only while the device is in the
               actor's layout). Every actor call below goes through the protocol's verbs
               (tidal/engine/backends/protocol.py), so the roles do not depend on which engine trains
    rollout    RolloutSlot (RolloutInstance + NativeEngine) while the device serves rollout (its calls:
               `tidal.workers.roles_rollout`; moving its requests: `tidal.workers.roles_migration`)
    inference  InferenceSlot (the model with the current weights) while the device serves inference
    kept       KeptCopy: the actor's full weights as they were at the last step end, on devices where the actor
               then held a whole replica (`actor_keep_weights`); the next version's engines on this device load
               them in place (`weights=KeptWeights(version)`)

Values crossing the driver are records (`tidal.engine.records`, `tidal.workers.messages`) or dicts of tensors
(global weights by parameter name), never dicts with reserved keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, cast

import torch
import torch.distributed as dist

from tidal.engine.actor import Coord, IterReport, LossFn, SharedQueue
from tidal.engine.backends.protocol import ActorBackend, PolicyModel, ProgramInputs, make_backend
from tidal.engine.evaluation import EvalItem, greedy_accuracy
from tidal.engine.generation.engine import NativeEngine
from tidal.engine.generation.requests import SamplingParams
from tidal.engine.grpo import (
    ScoredSample,
    group_width,
    grpo_loss,
    iter_micro_batches,
    pack_samples,
    pack_sequences,
    unpack_response_logprobs,
)
from tidal.engine.hf_checkpoint import HFWeights
from tidal.engine.hf_tokenizer import Tokenizer, TokenizerSpec
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, Transformer, compute_dtype, param_specs
from tidal.engine.optim import OptimConfig
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.engine.reshard import PreparedProgram
from tidal.engine.rollout_correction import Correction
from tidal.engine.transfer import (
    BucketLayout,
    CudaIpcTensor,
    bucket_layout,
    open_shared,
    pack_buckets,
    recv_buckets,
    send_buckets,
    share,
    unpack,
    views,
)
from tidal.engine.verifier import Verifier
from tidal.workers.device_worker import WorkerContext
from tidal.workers.gc_pauses import GcPauses
from tidal.workers.messages import (
    BroadcastWeights,
    HandoverReport,
    KeptWeights,
    PeerWeights,
    RankWeights,
    ReshardReport,
    RolloutModel,
)
from tidal.workers.rollout_instance import GroupQueue, RolloutInstance
from tidal.workers.rollout_instance import RolloutGroup as FinishedGroup

if TYPE_CHECKING:
    from ray import ObjectRef

#: global weights as the driver sends them: tensors by parameter name, their reference in the object store
#: (`WorkerGroup.put`, or the `CallHandle.ref` of a call returning them), or a checkpoint each worker reads itself
GlobalWeights: TypeAlias = "dict[str, torch.Tensor] | ObjectRef[dict[str, torch.Tensor]] | HFWeights"
#: what an engine loads: global weights, the copy its worker kept (`KeptWeights`), a broadcast from the actor, or
#: another device's kept copy by the transfer layer (`PeerWeights`)
EngineWeights: TypeAlias = "GlobalWeights | KeptWeights | BroadcastWeights | PeerWeights"


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to play any role in one run (sent once)."""

    args: ModelArgs
    optim: OptimConfig
    sampling: SamplingParams
    max_running_requests: int
    group_size: int
    micro_batch_size: int
    clip_eps: float
    kl_coef: float
    tokenizer: TokenizerSpec
    reward: str | None
    """`reward.function` (None: the built-in tasks' exact verifier on the label's answer)."""
    reward_timeout_s: float
    vocab_limit: int | None
    """Generation samples ids below this (the tokenizer's size) when the embedding is padded past it."""
    seed: int
    gpu_memory_utilization: float = 0.5
    """Fraction of a GPU's memory a rollout engine fills with weights and KV blocks (CPU: unused)."""
    dtype: str = "auto"
    """`actor.dtype`: the compute dtype of the actor and of the engines (`model.compute_dtype`)."""
    activation_checkpointing: bool = False
    max_tokens_per_micro_batch: int | None = None
    """`actor.max_tokens_per_micro_batch`: the actor's micro-batches by token budget (None: micro_batch_size rows)."""
    backend: str = "native"
    """`actor.backend`: the registry name of the actor's training engine (`make_backend`)."""
    backend_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments only that backend takes (megatron: `transformer_engine`)."""
    correction: Correction | None = None
    """The loss's off-policy correction (`algorithm.rollout_is` / `use_decoupled_loss`), or None."""
    partial: Literal["keep", "recompute"] = "keep"
    """`rollout.partial`: what requests in flight at a weight sync do under the new weights (`rollout_start`)."""


@dataclass
class RolloutSlot:
    """A rollout instance on this worker: its engine, local queue, finished groups not yet returned, and the
    groups frozen by exports not yet committed or cancelled."""

    engine: NativeEngine
    queue: GroupQueue
    inst: RolloutInstance
    out: list[FinishedGroup]
    version: int
    step: int
    exporting: set[int] = field(default_factory=set)
    outbox: list[Any] | None = None
    """The packages of this instance's last export call, whose KV its `rollout_send_kv` streams (None: that
    export failed, its targets expect no stream)."""


@dataclass
class InferenceSlot:
    model: Transformer
    version: int


@dataclass
class KeptCopy:
    """The actor's weights of `version` as flat buckets in the compute dtype (`param_specs` order), and the
    named tensors as views into them: loaded in place here, sent or shared whole to other devices."""

    version: int
    buckets: list[torch.Tensor]
    layout: BucketLayout

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return views(self.buckets, self.layout)


@dataclass
class WorkerRoles:
    """Everything a worker holds for the run's roles (one per worker, made by `setup`)."""

    run: RunSpec
    tok: Tokenizer
    verifier: Verifier
    actor: ActorBackend | None = None
    rollout: RolloutSlot | None = None
    inference: InferenceSlot | None = None
    kept: KeptCopy | None = None


def roles_of(ctx: WorkerContext) -> WorkerRoles:
    roles: WorkerRoles = ctx.state["roles"]
    return roles


def actor_of(ctx: WorkerContext) -> ActorBackend:
    actor = roles_of(ctx).actor
    assert actor is not None, "actor_init runs before any other actor call"
    return actor


def rollout_slot(ctx: WorkerContext) -> RolloutSlot:
    slot = roles_of(ctx).rollout
    if slot is None:
        raise RuntimeError(f"device {ctx.device_id} is not a rollout instance")
    return slot


def _resolve(value: Any) -> Any:
    """Ray resolves ObjectRefs passed at top level only; our kwargs travel in a dict, so resolve here. A
    checkpoint's weights by reference (`HFWeights`) are read here, by this worker."""
    if isinstance(value, HFWeights):
        return value.load()
    try:
        import ray
        if isinstance(value, ray.ObjectRef):
            return ray.get(value)
    except ImportError:  # pragma: no cover - ray is a dependency
        pass
    return value


def setup(ctx: WorkerContext, spec: RunSpec) -> int:
    torch.set_num_threads(1)
    GcPauses.install()
    # a new driver numbers its slices from 0 again: interrupts left by an earlier one must not end them
    ctx.interrupt_upto.clear()
    ctx.state["roles"] = WorkerRoles(spec, spec.tokenizer.build(), Verifier(spec.reward, spec.reward_timeout_s))
    # Warm-up: the first model built on the meta device imports torch's meta kernels, seconds of CPU that a
    # capped device would otherwise spend inside the first reshard that brings it into the actor (measured:
    # 7 s of a 7.3 s reshard at 0.25 core).
    Transformer(spec.args, device=torch.device("meta"))
    return ctx.device_id


def freeze_gc(ctx: WorkerContext) -> None:
    """After setup (model, actor state, engine built): later collections skip what exists now (`GcPauses`)."""
    GcPauses.freeze()


# ---- actor ------------------------------------------------------------------------------------------------
def actor_init(ctx: WorkerContext, layout: Layout,
               weights: GlobalWeights | ObjectRef[dict[str, torch.Tensor] | None] | None) -> str:
    """Every worker: build its actor backend (`RunSpec.backend`; holding state only if in `layout`) from global
    `weights` (the engines' names; None: the backend's seeded initialization). Returns what it built
    (`ActorBackend.build`)."""
    roles = roles_of(ctx)
    spec = roles.run
    weights = _resolve(weights)
    roles.actor = actor = make_backend(spec.backend, spec.args, spec.optim, layout, ctx.rank, seed=spec.seed,
                                       device=ctx.device, dtype=compute_dtype(spec.dtype, ctx.device),
                                       activation_checkpointing=spec.activation_checkpointing,
                                       weights=weights if layout.coord(ctx.rank) is not None else "empty",
                                       **spec.backend_options)
    return actor.build


def _grpo_loss_fn(spec: RunSpec) -> tuple[LossFn, list[dict[str, float]]]:
    """The GRPO loss of one iter, and the list its calls append their micro-batch's metrics to."""
    collected: list[dict[str, float]] = []

    def loss_fn(model: Transformer, batch: Any, num_tokens_in_iter: int) -> torch.Tensor:
        logprobs, entropy = model.token_logprobs_entropy(batch.input_ids_BT)
        loss, metrics = grpo_loss(logprobs, batch, num_tokens_in_iter, clip_eps=spec.clip_eps, kl_coef=spec.kl_coef,
                                  correction=spec.correction)
        # the policy's entropy per response token (a sum-style share of the iter's mean, like grpo_loss's metrics)
        metrics["grpo/entropy"] = float((entropy * batch.response_mask_BT).sum()) / num_tokens_in_iter
        collected.append(metrics)
        return loss
    return loss_fn, collected


def actor_micro_batches(spec: RunSpec, samples: list[ScoredSample]) -> list[tuple[list[int], int]]:
    """The iter's micro-batches under the run's keys (`actor.max_tokens_per_micro_batch`, `micro_batch_size`)."""
    return iter_micro_batches(samples, max_tokens=spec.max_tokens_per_micro_batch, max_rows=spec.micro_batch_size,
                              cap=spec.args.max_seq_len)


def actor_train_iter(ctx: WorkerContext, samples: list[ScoredSample] | ObjectRef[list[ScoredSample]],
                     num_tokens: int) -> dict[str, float] | None:
    """Ranks of the actor's layout: one optimizer step on the iter's samples (micro-batches from one shared
    queue; static claim order, so the update is identical whatever the DP size). Others return None."""
    shard = actor_of(ctx)
    if not shard.member:
        return None
    spec, tok = roles_of(ctx).run, roles_of(ctx).tok
    scored: list[ScoredSample] = _resolve(samples)
    # shapes follow the tokens (tidal/engine/shapes.py): the same micro-batches whatever the DP size
    batches = [pack_samples([scored[i] for i in idx], tok.pad_id, width, behaviour=spec.correction is not None)
               .to(ctx.device)
               for idx, width in actor_micro_batches(spec, scored)]
    loss_fn, loss_metrics = _grpo_loss_fn(spec)
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    # None only on ranks outside the layout, returned above
    report = cast(IterReport, shard.train_iter(SharedQueue(batches), loss_fn, num_tokens))
    out = report.metrics()
    if cuda:   # the iter's peak on this device (the step's metric is the largest over ranks and iters)
        out["mem/actor_peak_bytes"] = float(torch.cuda.max_memory_allocated(ctx.device))
    for m in loss_metrics:  # sum-style metrics: this rank's share of the iter's value
        for k, v in m.items():
            if k != "grpo/loss":
                out[k] = out.get(k, 0.0) + v
    out["actor/microbatches"] = report.num_microbatches
    out["actor/gc_s"] = GcPauses.install().take()[0]
    return out


@torch.no_grad()
def actor_score(ctx: WorkerContext, groups: list[RolloutGroup]) -> list[list[torch.Tensor]] | None:
    """The actor's own log-probs of each group's responses (collective over the layout; TP rank 0 of DP rank 0
    returns them), packed exactly as the training loss packs them. Used to check inference against the actor."""
    shard = actor_of(ctx)
    if not shard.member:
        return None
    spec, tok = roles_of(ctx).run, roles_of(ctx).tok
    model: PolicyModel | None = shard.model
    if model is None:   # the driver's order: a hand-over to generation unbinds it until `actor_onload`
        raise RuntimeError(f"device {ctx.device_id}: the actor's weights are offloaded (actor_onload first)")
    out = []
    for g in groups:
        ids_BT, mask_BT = pack_sequences([g.prompt_ids] * len(g.response_ids), list(g.response_ids), tok.pad_id,
                                         group_width(g, spec.args.max_seq_len))
        out.append([lp.clone() for lp in unpack_response_logprobs(model.token_logprobs(ids_BT.to(ctx.device)),
                                                                  mask_BT)])
    return out if shard.coord == (0, 0) else None


def actor_program_inputs(ctx: WorkerContext) -> ProgramInputs | None:
    """Specs, parameter bytes and bucket size of this worker's actor: what the driver needs to prepare programs
    (None: the backend plans its own moves on the ranks)."""
    return actor_of(ctx).program_inputs()


def actor_reshard(ctx: WorkerContext, layout: Layout, current: Layout | None = None, local: bool = False,
                  prepared: PreparedProgram | None = None) -> ReshardReport:
    """Move the actor from `current` to `layout`: on every worker (collective over the world), or with `local`
    only on the workers of either layout (every group it needs exists; see tidal/engine/groups.py)."""
    shard = actor_of(ctx)
    t0 = time.perf_counter()
    shard.sync_layout(current)
    if not local:   # first use of a layout creates its groups (collective over the world)
        shard.groups.get(layout)
        shard.groups.union(shard.layout, layout)
    groups_s = time.perf_counter() - t0
    report = shard.reshard(layout, local=local, prepared=prepared)
    return ReshardReport(report.bytes_moved, report.seconds, shard.held_bytes(), report.prepared,
                         GcPauses.install().take()[0], groups_s, time.perf_counter() - t0,
                         dict(getattr(report, "phase_seconds", {})))


def actor_make_groups(ctx: WorkerContext, rank_sets: Sequence[Sequence[int]]) -> float:
    """Every worker (collective over the world, same order everywhere): make these rank sets' process groups now
    (engine.groups.growth_rank_sets), so later reshards among them are member-local. Returns seconds."""
    t0 = time.perf_counter()
    actor_of(ctx).groups.ensure(rank_sets)
    return time.perf_counter() - t0


def actor_set_layout(ctx: WorkerContext, layout: Layout) -> None:
    """A worker outside a member-local reshard learns the actor's new layout (queued behind its current call)."""
    actor_of(ctx).sync_layout(layout)


def actor_weights(ctx: WorkerContext) -> RankWeights | None:
    """DP rank 0 of each TP rank: its TP-local weights (CPU copies in the compute dtype), keyed by parameter name;
    others None."""
    shard = actor_of(ctx)
    exported = shard.export_weights()
    if exported is None or cast(Coord, shard.coord)[1] != 0:   # exported: the shard is in its layout
        return None
    return RankWeights(exported.t, {k: v.detach().to("cpu", copy=True) for k, v in exported.tensors.items()})


def actor_keep_weights(ctx: WorkerContext, version: int) -> bool:
    """Step end, before the actor leaves this device: keep a whole replica of its weights for generation
    `version` on every rank of the layout (TP 1: a copy; TP > 1: the TP group's shards all-gathered, collective
    over the layout). The next step's rollout or inference engine on this device loads them in place instead of
    through the driver (`Pipeline.sync_weights`). Returns whether a copy was kept (any older copy is dropped
    either way)."""
    roles = roles_of(ctx)
    roles.kept = None
    replica = actor_of(ctx).gather_replica()
    if replica is None:
        return False
    buckets, layout = _pack(ctx, replica)
    roles.kept = KeptCopy(version, buckets, layout)
    return True


def _kept(ctx: WorkerContext, version: int) -> KeptCopy:
    kept = roles_of(ctx).kept
    if kept is None or kept.version != version:
        # the driver's bookkeeping (`Generations.kept`) is wrong: a bug, not an input
        have = "none" if kept is None else f"version {kept.version}"
        raise RuntimeError(f"device {ctx.device_id} keeps no weights of version {version} (it has {have})")
    return kept


def actor_send_kept(ctx: WorkerContext, version: int, targets: Sequence[int]) -> int:
    """Send the kept copy of `version` to each target device in order (each loads `PeerWeights` by p2p at the
    same time). Returns the bytes sent."""
    kept = _kept(ctx, version)
    return sum(send_buckets(kept.buckets, ctx.rank_of(t), ctx.group) for t in targets)


def actor_share_kept(ctx: WorkerContext, version: int) -> tuple[CudaIpcTensor, ...]:
    """CUDA IPC handles of the kept copy's buckets, for engines on this GPU (`PeerWeights` by ipc). The copy
    stays until the next step end replaces it."""
    return tuple(share(b) for b in _kept(ctx, version).buckets)


def drop_kept(ctx: WorkerContext) -> None:
    """The engines on this device have loaded the kept copy: free it (static shared placements start no engine
    mid-step that would need it)."""
    roles_of(ctx).kept = None


def actor_offload(ctx: WorkerContext, optimizer: bool, grad: bool, weight: bool) -> HandoverReport:
    """Hand this device to generation: the actor's state as `ActorBackend.offload` says. Returns the bytes moved,
    the seconds, the actor's bytes still on the device, and (CUDA) the device's peak since the last hand-over:
    the training phase's."""
    return _hand_over(ctx, lambda shard: shard.offload(optimizer=optimizer, grad=grad, weight=weight))


def actor_onload(ctx: WorkerContext) -> HandoverReport:
    """Hand this device back to training: what `actor_offload` moved comes back (bit for bit). Returns as
    `actor_offload` does; the peak is the generation (and scoring) phase's."""
    return _hand_over(ctx, lambda actor: actor.onload())


def _hand_over(ctx: WorkerContext, move: Callable[[ActorBackend], int]) -> HandoverReport:
    """`move(shard) -> bytes`, timed, with the phase it ends measured first (`_device_memory`)."""
    shard = actor_of(ctx)
    allocated, peak = _device_memory(ctx)
    t0 = time.perf_counter()
    moved = move(shard)
    return HandoverReport(float(moved), time.perf_counter() - t0, float(shard.resident_bytes()), allocated, peak)


def _device_memory(ctx: WorkerContext) -> tuple[float | None, float | None]:
    """This device's allocated bytes now and its peak since the last call, which starts a new peak (CUDA; None
    on CPU)."""
    if ctx.device.type != "cuda":
        return None, None
    out = float(torch.cuda.memory_allocated(ctx.device)), float(torch.cuda.max_memory_allocated(ctx.device))
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return out


def engine_weights(ctx: WorkerContext, weights: EngineWeights) -> dict[str, torch.Tensor]:
    """The global weights an engine given `weights` on this worker loads, as host tensors (for checks)."""
    return {k: v.to("cpu", copy=True) for k, v in load_weights(ctx, weights).items()}


def kept_weights(ctx: WorkerContext, version: int) -> dict[str, torch.Tensor]:
    """The kept copy of `version` as global CPU tensors in the compute dtype (what `Pipeline.global_weights`
    returns): for an instance started mid-step on a device that kept none."""
    return {k: v.to("cpu", copy=True) for k, v in load_weights(ctx, KeptWeights(version)).items()}


def actor_broadcast_weights(ctx: WorkerContext, plan: BroadcastWeights) -> int:
    """The actor's device `plan.src` (at TP > 1 every device of the layout: `gather_replica` is collective over it)
    broadcasts the whole weights to the engines of `plan.ranks` (they receive in `_receive`) as flat buckets in
    the compute dtype (`tidal.engine.transfer.pack_buckets`, `param_specs` order): the kept copy's own buckets
    where this device kept the version. Returns the bytes this device sent."""
    shard, kept = actor_of(ctx), roles_of(ctx).kept
    buckets: list[torch.Tensor] | None = None
    if kept is not None and kept.version == plan.version and shard.layout.tp == 1:
        buckets = kept.buckets   # the copy kept at the step end: no second one
    else:
        replica = shard.gather_replica()
        if replica is not None and ctx.device_id == plan.src:
            buckets, _ = _pack(ctx, replica)
    if ctx.device_id != plan.src:
        return 0
    if buckets is None:   # the driver names the layout's first device: a bug, not an input
        raise RuntimeError(f"device {ctx.device_id} holds no actor weights to broadcast (version {plan.version})")
    group = cast(dist.ProcessGroup, shard.groups.of_ranks(plan.ranks))   # >= 2 ranks: a group
    for b in buckets:
        dist.broadcast(b, src=plan.src, group=group)
    return sum(b.numel() * b.element_size() for b in buckets)


def _layout(ctx: WorkerContext) -> BucketLayout:
    """The buckets every copy of the weights is laid out in: `param_specs` order, the compute dtype."""
    spec = roles_of(ctx).run
    return bucket_layout([(s.name, s.shape) for s in param_specs(spec.args)], compute_dtype(spec.dtype, ctx.device))


def _pack(ctx: WorkerContext, weights: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], BucketLayout]:
    spec = roles_of(ctx).run
    return pack_buckets([(s.name, weights[s.name]) for s in param_specs(spec.args)],
                        compute_dtype(spec.dtype, ctx.device), ctx.device)


def _receive(ctx: WorkerContext, plan: BroadcastWeights) -> dict[str, torch.Tensor]:
    """The weights `actor_broadcast_weights` sends, received on this device (views into the buckets)."""
    group = cast(dist.ProcessGroup, actor_of(ctx).groups.of_ranks(plan.ranks))
    layout = _layout(ctx)
    buckets = [torch.empty(n, dtype=getattr(torch, layout.dtype), device=ctx.device) for n in layout.sizes]
    for b in buckets:
        dist.broadcast(b, src=plan.src, group=group)
    return views(buckets, layout)


def load_weights(ctx: WorkerContext, weights: EngineWeights) -> dict[str, torch.Tensor]:
    """Global weights from a driver-side value (dict or object ref), `KeptWeights`: this worker's kept copy, or
    `BroadcastWeights`: received from the actor's device now."""
    if isinstance(weights, BroadcastWeights):
        return _receive(ctx, weights)
    if isinstance(weights, KeptWeights):
        return _kept(ctx, weights.version).weights
    if isinstance(weights, PeerWeights):
        return _from_peer(ctx, weights)
    return _resolve(weights)


def _from_peer(ctx: WorkerContext, w: PeerWeights) -> dict[str, torch.Tensor]:
    """The kept copy of device `w.src`, received (p2p) or mapped and copied (ipc) into tensors of this worker."""
    layout = _layout(ctx)
    if w.route == "p2p":
        return views(recv_buckets(layout, ctx.rank_of(w.src), ctx.device, ctx.group), layout)
    mapped = [open_shared(h) for h in w.handles]
    out = unpack(mapped, layout, ctx.device)
    torch.cuda.current_stream().synchronize()   # copied out before the source may drop its copy
    return out


# ---- rollout ----------------------------------------------------------------------------------------------
def engine_model(spec: RunSpec, weights: dict[str, torch.Tensor], device: torch.device) -> Transformer:
    """An engine's model in the actor's compute dtype (its log-probs then match the actor's at ratio 1)."""
    model = Transformer(spec.args, dtype=compute_dtype(spec.dtype, device), device=device)
    model.load_global(weights)
    model.eval()
    return model


def abandon_engines(ctx: WorkerContext) -> None:
    """A step abandoned (a device lost beyond what the step absorbs, `tidal.pipeline.survivors`): drop this
    worker's rollout engine, its requests in flight included (their groups are generated again from their
    prompts), its scoring model and any kept weights copy. The actor's state is replaced by the load that
    follows."""
    roles = roles_of(ctx)
    roles.rollout = roles.inference = roles.kept = None   # the engine goes with its last reference
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


# ---- inference --------------------------------------------------------------------------------------------
def inference_load(ctx: WorkerContext, weights: EngineWeights | RolloutModel, version: int) -> int:
    """Score with the weights of `version`: `weights` global weights (or an object ref), `KeptWeights` (this
    worker's kept copy), or `RolloutModel`: the model of this worker's rollout engine (a device rollout and
    inference share holds one copy of the weights)."""
    roles = roles_of(ctx)
    roles.inference = None
    if isinstance(weights, RolloutModel):
        r = roles.rollout
        if r is None or r.version != weights.version:
            have = "no rollout engine" if r is None else f"a rollout engine of version {r.version}"
            raise RuntimeError(f"device {ctx.device_id} has {have}, not one of version {weights.version}")
        roles.inference = InferenceSlot(r.engine.model, version)
        return version
    roles.inference = InferenceSlot(engine_model(roles.run, load_weights(ctx, weights), ctx.device), version)
    return version


@torch.no_grad()
def inference_score(ctx: WorkerContext, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    """Old-policy log-probs of each arriving group under the current weights.

    Each group is scored as its own [group_size, padded longest sequence] batch (`group_width`): the shapes,
    and so the round-off, do not depend on which groups happened to arrive together, which keeps a dynamic
    run bit-identical to a static one."""
    roles = roles_of(ctx)
    inf = roles.inference
    assert inf is not None, "inference_load runs before inference_score"
    model = inf.model
    out = []
    for g in groups:
        ids_BT, mask_BT = pack_sequences([g.prompt_ids] * len(g.response_ids), list(g.response_ids), roles.tok.pad_id,
                                         group_width(g, model.args.max_seq_len))
        lps = unpack_response_logprobs(model.token_logprobs(ids_BT.to(ctx.device)), mask_BT)
        out.append(g.scored(tuple(lp.clone() for lp in lps), inf.version))
    return out


def inference_release(ctx: WorkerContext) -> None:
    roles_of(ctx).inference = None
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def evaluate(ctx: WorkerContext, items: list[EvalItem]) -> float:
    """Greedy held-out accuracy with this worker's inference weights."""
    roles = roles_of(ctx)
    assert roles.inference is not None, "inference_load runs before evaluate"
    return greedy_accuracy(roles.inference.model, items, roles.tok, roles.verifier,
                           roles.run.sampling.max_new_tokens, roles.run.max_running_requests)
