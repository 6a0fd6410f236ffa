"""The actor shard on one world rank: TP model + ZeRO-1 AdamW, trained from a shared micro-batch queue.

One `ActorShard` per world rank (= device id). Every world rank constructs it and calls `reshard` at the same
points (group creation and reshard votes are collective over the world); only ranks in the layout train.

An iter (one optimizer step) on rank (t, d)::

    claim micro-batch i from the shared queue ---> loss_fn(model, mb, num_tokens_in_iter).backward()
          (TP ranks of a DP group agree on i)         grads land in one flat buffer (p.grad are views)
    ... until the queue is empty
    grad sync (DP group): each owner receives, for every micro-batch, the grad of its owned ranges from the rank
          that ran it, and sums them in micro-batch index order (dp = 1: autograd already summed in that order)
    clip: global L2 norm, fp64 squares, all-reduce over the layout (TP-replicated params counted once, on t = 0)
    AdamW on the owned fp32 master ranges (tidal/engine/optim.py)
    publish: params[owned] = master (cast), all-gather the owned ranges over the DP group

Because the loss is a sum over tokens divided by the iter's token count and the per-micro-batch grads are added in
index order, the update is bit-identical for every DP size and every assignment of micro-batches to ranks (at the
same TP; TP changes the matmul reduction order, so TP sizes agree to fp32 round-off only). The "allreduce" grad
sum mode (local accumulation, all-reduce, slice) moves less data per iter but depends on DP at round-off level.

RNG: each rank's torch generator is seeded from `rng_seed(seed, step, t, d)` at init and again at the end of every
iter, so between iters it is a pure function of its coordinates and step; a reshard keeps it for coordinates the
old layout had and seeds it by the same rule otherwise, so the stream never depends on the resharding history.

Parameters are views of one flat buffer (`ShardState.flat_param`) so a reshard moves flat ranges and a new layout
only rebinds a model built on the meta device to new storage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, cast

import torch
import torch.distributed as dist
from torch import nn

from tidal.core.errors import LayoutError, TrainingError
from tidal.engine.generation.weights import rollout_shard
from tidal.engine.groups import GroupCache, reshard_rank_sets
from tidal.engine.layout import Layout, ParamSpec, synced_layout
from tidal.engine.model import ModelArgs, Transformer, check_tp, init_global_weights, param_specs, rope_tables
from tidal.engine.optim import (
    OPT_KINDS,
    BufferPool,
    OptimConfig,
    ShardState,
    ZeroShape,
    adamw_update,
    clip_coefficient,
    lr_at,
    rng_seed,
)
from tidal.engine.reshard import ReshardReport
from tidal.engine.reshard.commit import reshard_state

# (t, d) of a rank in a layout. The methods that train, sum and publish run only on the layout's members, where
# `coord` and `state` are set (and so are they for the DP peers): they cast away the None of those attributes.
Coord = tuple[int, int]

LossFn = Callable[[Transformer, Any, int], torch.Tensor]


class MicrobatchSource(Protocol):
    """The iter's shared queue. `claim(d, dp)`: (index, micro-batch) for DP rank d, or None when empty."""

    def claim(self, d: int, dp: int) -> tuple[int, Any] | None: ...


class SharedQueue:
    """A fixed list of micro-batches shared by the DP ranks of one iter.

    Without a store the claim rule is static (rank d takes d, d + dp, ...); with a torch.distributed Store the
    ranks take the next index from one atomic counter (`store.add`), so faster ranks take more. Either way the
    update is the same (grads are summed in index order). With TP > 1 only TP rank 0 claims, then broadcasts.
    """

    def __init__(self, microbatches: list, store=None, key: str = "tidal/mbq"):
        self.items, self.store, self.key = list(microbatches), store, key
        self._next: int | None = None
        self.dynamic = store is not None

    def __len__(self) -> int:
        return len(self.items)

    def claim(self, d: int, dp: int) -> tuple[int, Any] | None:
        if self.store is not None:
            i = self.store.add(self.key, 1) - 1
        else:
            self._next = d if self._next is None else self._next + dp
            i = self._next
        return (i, self.items[i]) if i < len(self.items) else None


#: where an iter's seconds go on one rank (`IterReport.phases`, metrics `actor/iter_<phase>_s`)
ITER_PHASES = ("compute", "sync", "update", "publish")


@dataclass(frozen=True)
class IterReport:
    loss: float                # sum over the iter's micro-batches of loss_fn values (token-mean loss)
    grad_norm: float           # before clipping
    lr: float
    clipped: bool
    num_microbatches: int      # run by this rank
    seconds: float
    # where the seconds went on this rank: forward/backward of its micro-batches, the gradient sum over DP
    # (waits for the slowest rank included), clip + AdamW on its shard, and the all-gather of the new weights
    phases: dict[str, float] = field(default_factory=dict)
    skipped: bool = False      # the gradient norm or loss was not finite and actor.on_nonfinite is skip

    def metrics(self) -> dict[str, float]:
        out = {"actor/loss": self.loss, "actor/grad_norm": self.grad_norm, "actor/lr": self.lr,
               "actor/iter_s": self.seconds, "actor/nonfinite_skipped_frac": float(self.skipped)}
        out.update({f"actor/iter_{k}_s": v for k, v in self.phases.items()})
        return out


@dataclass(frozen=True)
class ExportedWeights:
    """TP-local weights for rollout sync: tensors[name] is TP shard t of tp (views: copy before training on)."""

    tp: int
    t: int
    specs: tuple[ParamSpec, ...]
    tensors: dict[str, torch.Tensor]


def nll_loss(model: Transformer, ids_BT: torch.Tensor, num_tokens_in_iter: int) -> torch.Tensor:
    """Next-token NLL summed over the micro-batch, divided by the iter's token count (tests, benchmarks)."""
    return -model.token_logprobs(ids_BT).sum() / num_tokens_in_iter


def claim_microbatch(source, layout: Layout, coord: Coord, tp_group, device: torch.device) -> tuple[int, Any] | None:
    """The next (index, micro-batch) of the iter's queue for the rank at `coord` of `layout`, or None when it is
    empty. From a dynamic source at TP > 1 only TP rank 0 claims and broadcasts the index over its TP group
    (`tp_group`), so the TP ranks of a DP group run the same micro-batch."""
    t, d = coord
    dynamic = getattr(source, "dynamic", False) and tp_group is not None
    got = source.claim(d, layout.dp) if (t == 0 or not dynamic) else None
    if not dynamic:
        return got
    idx = torch.tensor([got[0] if got is not None else -1], dtype=torch.int64, device=device)
    dist.broadcast(idx, src=layout.device(0, d), group=tp_group)
    i = int(idx.item())
    if i < 0:
        return None
    return got if got is not None else (i, source.items[i])


def check_local_reshard(groups: GroupCache, layout: Layout, new_layout: Layout, rank: int) -> None:
    """A member-local reshard `layout` -> `new_layout` may run on `rank`: every group it needs exists already
    (`reshard_rank_sets`: made by an earlier world-wide reshard between the same layouts' rank sets) and the rank
    is in either layout; else LayoutError naming the way out, and nothing moves."""
    missing = [r for r in reshard_rank_sets(layout, new_layout) if not groups.has(r)]
    if missing:
        raise LayoutError("reshard", f"{layout} -> {new_layout}", f"a member-local reshard needs "
                          f"groups not made yet: {missing[:3]}", "reshard world-wide once (local=False)")
    if rank not in new_layout.devices and rank not in layout.devices:
        raise LayoutError("reshard", f"{layout} -> {new_layout}", f"rank {rank} is in neither "
                          "layout of a member-local reshard", "call it on the ranks of either layout only")


def _overlappable(source) -> bool:
    """The claim order is known before the iter (a static `SharedQueue`: DP rank d takes d, d + dp, ...) and the
    backend lets receives wait while sends are issued (gloo: matched by tag). NCCL runs a pair's P2P operations in
    issue order on one stream, so early receives on both sides of a pair would deadlock: it keeps the batched
    exchange after the last backward."""
    return (not getattr(source, "dynamic", False) and hasattr(source, "__len__")
            and dist.get_backend() == dist.Backend.GLOO)


class _OverlappedSum:
    """The ordered gradient sum with the exchange overlapping the iter's compute.

    Every rank knows which DP rank holds each micro-batch (the static claim order), so it posts the receives of
    its optimizer range for every micro-batch another rank holds before the first forward, and sends each of its
    own micro-batches' slices (one per peer's range) as soon as that micro-batch's backward is done. `finish` waits
    for the exchange and sums the parts in index order: the same additions in the same order as `_ordered_sum`,
    so the update is bit-identical; only the waiting moves under the next micro-batches' compute. After the last
    backward, on 8 host cores with one rank each, the exchange takes 0.13 s of a 0.69 s iter at dp 2 and 0.09 of
    0.30 s at dp 8."""

    def __init__(self, shard: ActorShard, n: int):
        st, lay = cast(ShardState, shard.state), shard.layout
        t, _ = cast(Coord, shard.coord)
        self.shard, self.shape = shard, st.shape
        self.peers = [(r, st.shape.peer(cast(Coord, lay.coord(r))[1])) for r in shard._dp_ranks() if r != shard.rank]
        self.parts: dict[int, torch.Tensor] = {}
        self.works: list = []
        self.sent: list[torch.Tensor] = []   # kept alive until the sends complete
        if st.shape.opt_total:
            for i in range(n):
                holder = lay.device(t, i % lay.dp)
                if holder != shard.rank:
                    buf = torch.empty(st.shape.opt_total, dtype=shard.dtype, device=shard.device)
                    self.parts[i] = buf
                    self.works.append(dist.irecv(buf, src=holder, tag=i))

    def add(self, i: int, grad: torch.Tensor) -> None:
        """Micro-batch `i`'s gradient (this rank's): its peers' slices leave now, its own slice is kept."""
        for r, peer in self.peers:
            if peer.opt_total:
                part = self.shard._pack(grad, peer)
                self.sent.append(part)
                self.works.append(dist.isend(part, dst=r, tag=i))
        self.parts[i] = self.shard._pack(grad, self.shape)

    def finish(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        acc = torch.zeros(self.shape.opt_total, dtype=torch.float32, device=self.shard.device)
        for i in sorted(self.parts):
            acc.add_(self.parts[i].float())
        self.sent.clear()
        return acc


class ActorShard:
    """Model + optimizer state of one world rank; see module doc. Construct on every world rank (collective)."""

    def __init__(self, args: ModelArgs, hp: OptimConfig, layout: Layout, rank: int, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None, *,
                 groups: GroupCache | None = None, grad_sum: Literal["ordered", "allreduce"] = "ordered",
                 bucket_bytes: int = 16 << 20, weights: dict[str, torch.Tensor] | Literal["empty"] | None = None,
                 keep_pool_on_leave: bool = False, overlap_grad_sum: bool = True,
                 activation_checkpointing: bool = False):
        check_tp(args, layout.tp)
        self.args, self.hp, self.rank, self.seed = args, hp, rank, seed
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.grad_sum, self.bucket_bytes = grad_sum, bucket_bytes
        # the ordered sum's exchange overlaps the iter's compute where it can (`_OverlappedSum`); off: it runs after
        # the last backward (benchmarks/grad_sum.py compares the two)
        self.overlap_grad_sum = overlap_grad_sum
        # a rank that leaves the actor frees its memory (the device goes to rollout); benchmarks of repeated
        # reshards on dedicated devices keep the buffers pooled instead
        self.keep_pool_on_leave = keep_pool_on_leave
        # each layer's activations recomputed in the backward: memory for compute (`actor.activation_checkpointing`)
        self.activation_checkpointing = activation_checkpointing
        self.specs = tuple(param_specs(args))
        self.groups = groups or GroupCache()
        self.pool = BufferPool()
        self._skeletons: dict[Layout, tuple[Transformer, list]] = {}
        self.layout = layout
        self.groups.get(layout)
        self.state: ShardState | None = None
        self.model: Transformer | None = None
        self._grad: torch.Tensor | None = None
        self.offloaded: set[str] = set()   # state buffers in host memory, "grad" freed (`offload`) until `onload`
        coord = layout.coord(rank)
        if coord is None:
            return
        t, d = coord
        shape = ZeroShape.of(self.specs, layout.tp, layout.dp, t, d)
        rng = torch.Generator(self.device).manual_seed(rng_seed(seed, 0, t, d))
        st = ShardState.allocate(shape, self.dtype, self.device, self.pool, rng)
        if weights != "empty":
            weights = weights if weights is not None else init_global_weights(args, seed)
            for i, spec in enumerate(self.specs):
                local = weights[spec.name][spec.tp_slices(layout.tp, t)].reshape(-1).to(self.device, torch.float32)
                off, n = shape.param_offsets[i], shape.param_numel[i]
                st.flat_param[off:off + n].copy_(local)
                lo, hi = shape.owned[i]
                st.master[shape.opt_offsets[i]:shape.opt_offsets[i] + hi - lo].copy_(local[lo:hi])
            st.exp_avg.zero_()
            st.exp_avg_sq.zero_()
        self.state = st
        self._bind()

    # ---- model over flat storage -------------------------------------------------------------------
    @property
    def coord(self) -> tuple[int, int] | None:
        return self.layout.coord(self.rank)

    def _bind(self) -> None:
        """Point a model of this layout at the state's flat storage (skeletons are built once per layout)."""
        if self.layout not in self._skeletons:
            g = self.groups.get(self.layout)
            model = Transformer(self.args, g.tp, self.dtype, device=torch.device("meta"))
            model.activation_checkpointing = self.activation_checkpointing
            cos, sin = rope_tables(self.args, self.device)
            model.register_buffer("rope_cos", cos, persistent=False)
            model.register_buffer("rope_sin", sin, persistent=False)
            slots = [(model.get_submodule(s.name.rpartition(".")[0]), s.name.rpartition(".")[2]) for s in self.specs]
            self._skeletons[self.layout] = (model, slots)
        model, slots = self._skeletons[self.layout]
        for i, (mod, pname) in enumerate(slots):
            mod._parameters[pname] = nn.Parameter(cast(ShardState, self.state).param(i))
        self.model = model
        self._grad = None

    def _grad_buffer(self) -> torch.Tensor:
        if self._grad is None:
            st, model = cast(ShardState, self.state), cast(Transformer, self.model)
            self._grad = self.pool.take(st.shape.param_total, self.dtype, self.device)
            for i, spec in enumerate(self.specs):
                mod_name, _, pname = spec.name.rpartition(".")
                off, n = st.shape.param_offsets[i], st.shape.param_numel[i]
                p = cast(nn.Parameter, model.get_submodule(mod_name)._parameters[pname])
                p.grad = self._grad[off:off + n].view(p.shape)
        self._grad.zero_()
        return self._grad

    # ---- training ------------------------------------------------------------------------------------
    def train_iter(self, source: MicrobatchSource, loss_fn: LossFn, num_tokens_in_iter: int) -> IterReport | None:
        """One optimizer step over the iter's queue (collective over the layout). None on ranks outside it."""
        if self.state is None:
            return None
        self._require_resident("train_iter")
        start = time.perf_counter()
        st, g = self.state, self.groups.get(self.layout)
        owned, losses, t_compute = self._owned_grads(source, loss_fn, num_tokens_in_iter, g)
        t_sync = time.perf_counter()
        sumsq = self._sumsq(owned)
        loss_t = torch.stack(losses).sum().reshape(1) if losses else torch.zeros(1, dtype=torch.float64)
        loss_t = loss_t.to(self.device)
        if g.dp is not None:
            dist.all_reduce(loss_t, group=g.dp)
        loss_sum = float(loss_t.item())
        # sumsq is global and the loss summed over DP (TP ranks compute the same one): every rank of the layout
        # takes the same branch, so none waits in a collective the others left
        finite = math.isfinite(sumsq) and math.isfinite(loss_sum)
        if not finite and self.hp.on_nonfinite == "stop":
            raise TrainingError("actor.on_nonfinite", "stop", f"optimizer step {st.step} has gradient norm "
                                f"{sumsq ** 0.5} and loss {loss_sum}: it was not applied (weights and Adam moments are "
                                "as before it)", "resume from the last good checkpoint with a lower actor.lr or "
                                "actor.grad_clip, or set actor.on_nonfinite: skip to drop such updates")
        lr = lr_at(self.hp, st.step)
        coef = clip_coefficient(sumsq, self.hp) if finite else None
        if coef is not None:
            owned.mul_(coef)
        if finite:
            adamw_update(st, owned, lr, self.hp)
        t_update = time.perf_counter()
        self._publish(g)
        t_publish = time.perf_counter()
        # between iters the generator is a pure function of (seed, step, t, d): resharding (which keeps it for
        # the same coordinates and seeds it from the same rule otherwise) never changes the random stream
        st.rng.manual_seed(rng_seed(self.seed, st.step, *cast(Coord, self.coord)))
        st.data_cursor += len(cast(Sized, source)) if hasattr(source, "__len__") else 0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        marks = (start, t_compute, t_sync, t_update, t_publish)
        phases = {p: b - a for p, a, b in zip(ITER_PHASES, marks, marks[1:])}
        return IterReport(loss_sum, sumsq ** 0.5, lr, coef is not None, len(losses), end - start, phases,
                          skipped=not finite)

    def _owned_grads(self, source: MicrobatchSource, loss_fn: LossFn, num_tokens_in_iter: int, g
                     ) -> tuple[torch.Tensor, list[torch.Tensor], float]:
        """Run the iter's micro-batches and sum their grads over DP: (this rank's owned ranges of the summed
        grad in fp32, the micro-batches' losses, the time the last backward ended)."""
        st, lay = cast(ShardState, self.state), self.layout
        grad = self._grad_buffer()
        ordered = lay.dp > 1 and self.grad_sum == "ordered"
        early = _OverlappedSum(self, len(cast(Sized, source))) \
            if ordered and self.overlap_grad_sum and _overlappable(source) else None
        acc32 = torch.zeros(st.shape.param_total, device=self.device) if self.dtype != torch.float32 else None
        mine: list[tuple[int, torch.Tensor]] = []
        losses = []
        while (item := claim_microbatch(source, lay, cast(Coord, self.coord), g.tp, self.device)) is not None:
            idx, mb = item
            loss = loss_fn(cast(Transformer, self.model), mb, num_tokens_in_iter)
            loss.backward()
            losses.append(loss.detach().double())
            if early is not None:
                early.add(idx, grad)
                grad.zero_()
            elif ordered:
                mine.append((idx, grad.clone()))
                grad.zero_()
            elif acc32 is not None:
                acc32.add_(grad.float())
                grad.zero_()
        full = acc32 if acc32 is not None else grad
        t_compute = time.perf_counter()
        if lay.dp == 1:
            owned = full.float()
        elif early is not None:
            owned = early.finish()
        elif ordered:
            owned = self._ordered_sum(mine, g)
        else:
            dist.all_reduce(full, group=g.dp)
            owned = self._pack(full.float(), st.shape)
        return owned, losses, t_compute

    def _pack(self, flat: torch.Tensor, shape: ZeroShape) -> torch.Tensor:
        """The owned ranges of `shape` out of a TP-local flat tensor, in optimizer order."""
        out = torch.empty(shape.opt_total, dtype=flat.dtype, device=flat.device)
        segs = shape.owned_segments()
        if segs:
            torch._foreach_copy_([out[o:o + n] for _, o, n in segs], [flat[p:p + n] for p, _, n in segs])
        return out

    def _dp_ranks(self) -> list[int]:
        """Global ranks of this rank's DP group in group-rank order (torch sorts group members by id)."""
        return sorted(self.layout.dp_group(cast(Coord, self.coord)[0]))

    def _ordered_sum(self, mine: list[tuple[int, torch.Tensor]], g) -> torch.Tensor:
        st, lay = cast(ShardState, self.state), self.layout
        members = self._dp_ranks()
        dev = self.device
        cnt = torch.tensor([len(mine)], dtype=torch.int64, device=dev)
        counts = [torch.empty_like(cnt) for _ in members]
        dist.all_gather(counts, cnt, group=g.dp)
        width = max(int(c.item()) for c in counts)
        idx = torch.full((max(width, 1),), -1, dtype=torch.int64, device=dev)
        idx[:len(mine)] = torch.tensor([i for i, _ in mine], dtype=torch.int64)
        gathered = [torch.empty_like(idx) for _ in members]
        dist.all_gather(gathered, idx, group=g.dp)
        holder = {int(i): r for r, ix in zip(members, gathered) for i in ix.tolist() if i >= 0}
        ops, parts = [], {}
        mine.sort(key=lambda x: x[0])  # per-pair message order = index order on both sides
        for i, gf in mine:
            for r in members:
                if r != self.rank:
                    peer = st.shape.peer(cast(Coord, lay.coord(r))[1])
                    if peer.opt_total:
                        ops.append(dist.P2POp(dist.isend, self._pack(gf, peer), r))
            parts[i] = self._pack(gf, st.shape)
        for i in sorted(holder):
            if holder[i] != self.rank and st.shape.opt_total:
                parts[i] = torch.empty(st.shape.opt_total, dtype=self.dtype, device=dev)
                ops.append(dist.P2POp(dist.irecv, parts[i], holder[i]))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        acc = torch.zeros(st.shape.opt_total, dtype=torch.float32, device=dev)
        for i in sorted(parts):
            acc.add_(parts[i].float())
        return acc

    def _sumsq(self, owned: torch.Tensor) -> float:
        st, t = cast(ShardState, self.state), cast(Coord, self.coord)[0]
        views = [owned[st.shape.opt_offsets[i]:st.shape.opt_offsets[i] + hi - lo]
                 for i, (lo, hi) in enumerate(st.shape.owned)
                 if hi > lo and (self.specs[i].tp_dim is not None or t == 0)]
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for v in views:
            total += v.double().pow(2).sum()
        g = self.groups.get(self.layout)
        if g.all is not None:
            dist.all_reduce(total, group=g.all)
        return float(total.item())

    def _publish(self, g) -> None:
        st = cast(ShardState, self.state)
        if self.layout.dp == 1:
            st.flat_param.copy_(st.master)
            return
        members = self._dp_ranks()
        shapes = [st.shape.peer(cast(Coord, self.layout.coord(r))[1]) for r in members]
        width = max(max(s.opt_total for s in shapes), 1)
        mine = torch.zeros(width, dtype=self.dtype, device=self.device)
        mine[:st.shape.opt_total].copy_(st.master)
        parts = [torch.empty_like(mine) for _ in members]
        dist.all_gather(parts, mine, group=g.dp)
        dst, src = [], []
        for s, part in zip(shapes, parts):
            for p, o, n in s.owned_segments():
                dst.append(st.flat_param[p:p + n])
                src.append(part[o:o + n])
        if dst:
            torch._foreach_copy_(dst, src)

    # ---- resharding ----------------------------------------------------------------------------------
    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None, *,
                local: bool = False, old_layout: Layout | None = None, prepared=None) -> ReshardReport:
        """Move this actor to `new_layout` (collective over the world; see tidal/engine/reshard). Raises ReshardError
        after a rollback on every rank, leaving the old layout intact.

        `local=True`: only the ranks in the old or the new layout call this (the others keep working); every
        group the move needs must exist already (`GroupCache.has` of `reshard_rank_sets`: they were made by an
        earlier world-wide reshard between the same layouts' rank sets), else LayoutError and nothing moves.
        `old_layout`: the actor's layout as the caller knows it; a rank that sat out local reshards (holding no
        state) catches up with it first. `prepared`: this rank's program made by the caller
        (`engine.reshard.commit.prepare_programs`), used when its inputs match this rank's, else planned here."""
        check_tp(self.args, new_layout.tp)
        self._require_resident("reshard")
        self.sync_layout(old_layout)
        if local:
            check_local_reshard(self.groups, self.layout, new_layout, self.rank)
        self.groups.get(new_layout)
        union = self.groups.union(self.layout, new_layout)
        new_state, report = reshard_state(self.state, self.layout, new_layout, self.specs, rank=self.rank,
                                          device=self.device, param_dtype=self.dtype, pool=self.pool,
                                          seed=self.seed, bucket_bytes=self.bucket_bytes, fault=fault,
                                          vote_group=union if local else None, prepared=prepared)
        if self._grad is not None:
            self.pool.give(self._grad)
        if self.state is not None:
            self.state.release(self.pool)
        self.state, self.layout, self.model, self._grad = new_state, new_layout, None, None
        if new_state is None and not self.keep_pool_on_leave:
            self.free()  # left the actor: give the memory back
        elif new_state is not None:
            self._bind()
        return report

    def program_inputs(self) -> dict:
        """What a caller needs to prepare this actor's reshard programs (`prepare_programs`)."""
        return {"specs": self.specs, "param_bytes": torch.empty((), dtype=self.dtype).element_size(),
                "bucket_bytes": self.bucket_bytes}

    def sync_layout(self, layout: Layout | None) -> None:
        """A rank outside the actor that sat out member-local reshards learns the current layout (it holds no
        state, so nothing moves)."""
        self.layout = synced_layout(self.layout, layout, self.state is not None, self.rank)

    def adopt(self, layout: Layout, state: ShardState | None) -> None:
        """Swap in `state` of `layout`, built elsewhere (a checkpoint load, tidal/engine/checkpoint.py); the old buffers
        go to the pool. Every world rank calls it at the same point (group creation is collective)."""
        check_tp(self.args, layout.tp)
        self.groups.get(layout)
        if self._grad is not None:
            self.pool.give(self._grad)
        if self.state is not None:
            self.state.release(self.pool)
        self.state, self.layout, self.model, self._grad = state, layout, None, None
        self.offloaded.clear()   # the new state was built on the device
        if state is None and not self.keep_pool_on_leave:
            self.free()
        elif state is not None:
            self._bind()

    # ---- memory hand-over (devices the actor shares with generation) -------------------------------
    def offload(self, *, optimizer: bool, grad: bool, weight: bool) -> int:
        """Give the device to a generation engine while the actor idles on it: the fp32 master weights and Adam
        moments (`optimizer`) and the parameters (`weight`) move to host memory (pinned on CUDA, so `onload` is
        one async copy each); the grad buffer and the pooled buffers are freed (`grad`: between iters they hold
        nothing, `_grad_buffer` zeroes them before use). Returns the bytes that left the device. A no-op outside
        the layout or for what is off already. `onload` restores the state bit for bit; until then this rank
        neither trains nor reshards."""
        if self.state is None:
            return 0
        st, moved = self.state, 0
        for kind in (OPT_KINDS if optimizer else ()) + (("param",) if weight else ()):
            if kind in self.offloaded:
                continue
            dev = st.buffer(kind)
            host = torch.empty(dev.shape, dtype=dev.dtype, device="cpu", pin_memory=dev.is_cuda)
            host.copy_(dev)
            moved += dev.numel() * dev.element_size()
            self._set_buffer(kind, host)
            self.offloaded.add(kind)
        if (grad or weight) and self._grad is not None:   # the parameters' .grad are views of it
            moved += self._grad.numel() * self._grad.element_size()
            for p in cast(Transformer, self.model).parameters():
                p.grad = None
            self._grad = None
        if grad or weight:
            moved += self.pool.bytes()
            self.pool.clear()
            self.offloaded.add("grad")   # nothing to copy back; the rank still trains only after `onload`
        if weight:   # the bound model's parameters are views of the device buffer: unbind them too
            self._skeletons.pop(self.layout, None)
            self.model = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return moved

    def onload(self) -> int:
        """Back on the device what `offload` moved (bit for bit); returns the bytes copied."""
        if self.state is None or not self.offloaded:
            return 0
        moved = 0
        for kind in sorted(self.offloaded - {"grad"}):
            host = self.state.buffer(kind)
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dev.copy_(host, non_blocking=True)
            moved += host.numel() * host.element_size()
            self._set_buffer(kind, dev)
        rebind = "param" in self.offloaded
        self.offloaded.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if rebind or self.model is None:
            self._bind()
        return moved

    def resident_bytes(self) -> int:
        """Bytes of this rank's state, grad buffer and pooled buffers on the device (what `offload` leaves)."""
        if self.state is None:
            return 0
        n = sum(self.state.buffer(k).numel() * self.state.buffer(k).element_size()
                for k in ("param",) + OPT_KINDS if k not in self.offloaded)
        if self._grad is not None:
            n += self._grad.numel() * self._grad.element_size()
        return n + self.pool.bytes(self.device)

    def _set_buffer(self, kind: str, t: torch.Tensor) -> None:
        st = cast(ShardState, self.state)
        if kind == "param":
            st.flat_param = t
        else:
            setattr(st, kind, t)

    def _require_resident(self, op: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"actor rank {self.rank}: {op} while {sorted(self.offloaded)} are offloaded "
                               "(onload first)")

    def gather_replica(self) -> dict[str, torch.Tensor] | None:
        """The full weights (global shapes, compute dtype, on this device), on every rank of the layout: the TP
        shards of this rank's DP replica all-gathered over its TP group (collective over the layout; device to
        device). What an engine sharing this device loads, with no trip through the driver. None outside."""
        if self.state is None:
            return None
        self._require_resident("gather_replica")
        lay = self.layout
        d = cast(Coord, self.coord)[1]
        if lay.tp == 1:
            return {s.name: self.state.param(i).detach().clone() for i, s in enumerate(self.specs)}
        shapes = [ZeroShape.of(self.specs, lay.tp, lay.dp, r, d) for r in range(lay.tp)]
        width = max(s.param_total for s in shapes)   # uneven vocab splits: TP shards differ in size
        mine = torch.zeros(width, dtype=self.dtype, device=self.device)
        mine[:self.state.shape.param_total].copy_(self.state.flat_param)
        parts = [torch.empty_like(mine) for _ in range(lay.tp)]
        dist.all_gather(parts, mine, group=self.groups.get(lay).tp)
        shards = [{spec.name: part[s.param_offsets[i]:s.param_offsets[i] + s.param_numel[i]]
                   .view(spec.tp_shape(lay.tp, r)) for i, spec in enumerate(self.specs)}
                  for r, (s, part) in enumerate(zip(shapes, parts))]
        return rollout_shard(self.args, shards, 1, 0)

    # ---- views for checks and rollout ----------------------------------------------------------------
    def state_dict_global(self) -> dict[str, torch.Tensor]:
        """Every tensor of the actor in global coordinates, on every rank (collective over the world; checks
        only). Keys: param/<name> (compute dtype as fp32), master|exp_avg|exp_avg_sq/<name>, step, data_cursor,
        rng [tp*dp, state bytes] (rank order of the layout)."""
        lay, st = self.layout, self.state
        coord = self.coord
        out: dict[str, torch.Tensor] = {}
        keys = [(i, kind) for i in range(len(self.specs)) for kind in ("param",) + OPT_KINDS]
        sizes = [self.specs[i].numel for i, _ in keys]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)  # one all-reduce for all
        fulls = [part.view(self.specs[i].shape) for part, (i, _) in zip(flat.split(sizes), keys)]
        for (i, kind), full in zip(keys, fulls):
            spec = self.specs[i]
            if st is not None:
                t, d = cast(Coord, coord)
                shard = full[spec.tp_slices(lay.tp, t)]
                counted = spec.tp_dim is not None or t == 0  # TP-replicated tensors: t = 0's copy only
                if kind == "param" and d == 0 and counted:
                    shard.copy_(st.param(i))
                elif kind != "param" and counted:
                    lo, hi = st.shape.owned[i]
                    o = st.shape.opt_offsets[i]
                    piece = torch.zeros(shard.numel(), dtype=torch.float32, device=self.device)
                    piece[lo:hi] = st.buffer(kind)[o:o + hi - lo]
                    shard.copy_(piece.view(shard.shape))
        dist.all_reduce(flat)  # each element has exactly one non-zero contributor: the sum is exact
        for (i, kind), full in zip(keys, fulls):
            out[f"{kind}/{self.specs[i].name}"] = full
        rng_len = torch.Generator(self.device).get_state().numel()
        scal = torch.zeros(2 + lay.size * rng_len, dtype=torch.int64, device=self.device)
        if st is not None:
            k = lay.devices.index(self.rank)
            if k == 0:
                scal[0], scal[1] = st.step, st.data_cursor
            scal[2 + k * rng_len:2 + (k + 1) * rng_len] = st.rng.get_state().to(torch.int64)
        dist.all_reduce(scal)
        out["step"], out["data_cursor"] = scal[0].clone(), scal[1].clone()
        out["rng"] = scal[2:].view(lay.size, rng_len).to(torch.uint8)
        return out

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own buffers and scalars (clones), for bitwise before/after comparisons."""
        if self.state is None:
            return {}
        st = self.state
        out = {k: st.buffer(k).clone() for k in ("param",) + OPT_KINDS}
        out["step"] = torch.tensor(st.step)
        out["data_cursor"] = torch.tensor(st.data_cursor)
        out["rng"] = st.rng.get_state().clone()
        return out

    def export_weights(self) -> ExportedWeights | None:
        if self.state is None:
            return None
        t = cast(Coord, self.coord)[0]
        return ExportedWeights(self.layout.tp, t, self.specs,
                               {s.name: self.state.param(i) for i, s in enumerate(self.specs)})

    def held_bytes(self) -> int:
        """Bytes of live state, grad buffer and pooled buffers on this rank."""
        n = self.state.nbytes() if self.state is not None else 0
        if self._grad is not None:
            n += self._grad.numel() * self._grad.element_size()
        return n + self.pool.bytes()

    def free(self) -> None:
        """Drop every buffer this rank holds (leaving the actor, or shutting down)."""
        if self.state is not None:
            self.state.release(None)
        self.state = self.model = self._grad = None
        self.pool.clear()
        self._skeletons.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
