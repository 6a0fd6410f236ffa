"""The bytes every device of a run will hold, planned from the config before any worker starts.

    plan = memory_plan(MemoryInputs.of(cfg, args, kind), capacity_of(kind, cfg.cluster.num_devices))
    plan.check()        # ConfigError naming the key that makes it fit, the numbers, and every fix

What a device holds, per component (`tidal.engine.actor`, `tidal.engine.optim`, `tidal.workers.roles`), for a model
of P parameters, P_t of them on TP rank t (`ZeroShape.param_total`), O = its ZeRO-1 range on DP rank d
(`ZeroShape.opt_total`, about P_t / dp), c = the compute dtype's bytes (`actor.dtype`: fp32 on CPU, bf16 on CUDA):

    actor weights        c x P_t                 `ShardState.flat_param`, replicated over DP
    actor masters        4 x O                   fp32 master weights of the owned range (megatron: 0 in fp32,
                                                 where the main params are the params)
    actor optimizer      8 x O                   Adam's exp_avg and exp_avg_sq, fp32
    actor grads          c x P_t (+ 4 x P_t)     the flat grad buffer; with c < 4 the iter's fp32 accumulator
                                                 (megatron: DDP's fp32 grad buffer, 4 x P_t)
    actor grad sum       c x (n x O + m x (P_t - O))   dp > 1, native backend: the ordered sum's buffers of an
                                                 iter of n micro-batches, m = ceil(n / dp) of them this rank's
                                                 (every part received, its own parts and the slices it sends;
                                                 on CUDA also m clones of the grad buffer, c x m x P_t)
    actor activations    tokens x A x c          tokens = actor.max_tokens_per_micro_batch, or micro_batch_size x
                                                 max_seq_len; A = per-token elements a decoder keeps for the
                                                 backward (below)
    actor logits         rows x V_t x 4          the fp32 logits `vocab_parallel_logprobs` holds: rows = the
                                                 micro-batch's tokens, cut to chunks of LOGPROB_CHUNK_ELEMENTS
                                                 (`Transformer.token_logprobs_entropy`)
    kept copy            c x P                   the whole replica an actor rank keeps at the step end for the
                                                 engines on its device (`actor_keep_weights`), while they load it
    rollout weights      c x P                   the engine's model (rollout and inference run TP 1)
    rollout kv           CUDA: gpu_memory_utilization x capacity - weights (`roles_rollout._kv_budget`); CPU: one
                         slot per running request at max_seq_len, 16-position blocks + the null block (`NativeEngine`)
    rollout logits       rows x V x 4            a decode step's logits (rows: max_running_requests, CPU: to 64s)
    actor checkpoint     2 x (c + 12) x O        CPU: a checkpoint's clones of the owned param, master and moments
                                                 and their serialized bytes (`checkpoint.write_shard`)
    inference weights    c x P                   the scorer's model (none where it reads the rollout engine's)
    inference logits     rows x V x 4            a group of group_size x max_seq_len tokens, chunked as above
    runtime              the worker process itself (CPU: interpreter, torch, Ray; CUDA: the context)

The runtime constants are a worker's proportional set size after setup (about 300 MB with Tidal's tiny models,
counted at 256 MiB) and the driver's with Ray's daemons.

A (per token, per layer, compute dtype; coarse: SDPA's own workspace, norms' statistics and the residual
stream's copies are left out): the layer input and the normed input (2h), q, k, v and the rotated q, k
((2 q + 3 kv) / tp), the attention output (q / tp), the post-attention input and its norm (2h), gate, up, their
SwiGLU and product (4 f / tp), the MLP output (h): 5 h + (3 q + 3 kv + 4 f) / tp, times num_layers. With
activation checkpointing: h per layer plus one layer's A, recomputed in the backward.

Phases. A device whose components share it (collocated, hybrid: `tidal.pipeline.sharing`) holds, at its worst
phase: generate (the actor's state less what `actor.offload_*` moves to host memory, the kept copy, the rollout
engine), score (the KV freed where rollout and inference share), train (the engines released, the whole actor),
checkpoint (the actor's state and its copies).
Where the actor and inference share devices scoring and training interleave: both are resident. Dynamic
scheduling (`cluster.auto_scheduler`) moves devices between components: a device's worst is then the largest of
its roles, the actor counted at its initial DP size on its initial devices and spread over every device (what
the step end's placement reaches) elsewhere.

Capacity. CUDA: each GPU's total memory. CPU virtual devices are processes of one machine: their sum, plus the
driver (its process and the global weights it builds and puts in Ray's object store, 4 x P), must fit the host's
available memory (MemAvailable, capped by the cgroup's limit). On CPU `actor.offload_optimizer` and
`offload_weight` move state to the same memory and save nothing; `offload_grad` frees the grad buffer.

The estimate is on the low side where the code's peak depends on data (sequence lengths, transient copies):
a config refused here does not fit; one accepted may still peak higher.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from tidal.core.config import TidalConfig
from tidal.core.errors import ConfigError
from tidal.core.placement import Placement
from tidal.engine.generation.engine import CPU_KV_BLOCK, CPU_ROW_MULTIPLE
from tidal.engine.layout import Layout
from tidal.engine.model import LOGPROB_CHUNK_ELEMENTS, ModelArgs, param_specs
from tidal.engine.optim import ZeroShape

GiB = float(1 << 30)

#: a CPU virtual device's worker process before it holds any tensor: interpreter, torch, Ray's worker (its
#: proportional set size, measured with Tidal's tiny models; libraries mapped by every worker counted once)
CPU_WORKER_BYTES = 256 << 20
#: the driver's process and Ray's own (GCS, raylet, dashboard) on a CPU run, besides the weights it builds
CPU_DRIVER_BYTES = 512 << 20
#: a CUDA context on each GPU (kernels, cuBLAS workspace), outside torch's allocator
CUDA_CONTEXT_BYTES = 512 << 20
#: the share of the host's available memory a CPU plan may fill (page cache, the OS and other processes grow)
CPU_HOST_SHARE = 0.9
#: the cgroup v2 / v1 files whose limit caps the host's available memory
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))

Kind = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class MemoryInputs:
    """What the plan reads from the config, the model and the machine: one typed value, so a candidate fix is a
    `replace` of one field (`fixes`)."""

    args: ModelArgs
    kind: Kind
    placement: Placement
    actor_tp: int
    backend: str                    #: actor.backend
    compute_bytes: int              #: c: bytes of an element in the compute dtype (actor.dtype on this kind)
    micro_batch_tokens: int         #: tokens of one actor micro-batch at the configured budget
    microbatches_per_iter: int      #: n: micro-batches of one iter (the grad sum's buffers)
    activation_checkpointing: bool
    offload_optimizer: bool
    offload_grad: bool
    offload_weight: bool
    gpu_memory_utilization: float
    max_running_requests: int
    max_seq_len: int
    score_tokens: int               #: tokens of one scored group: group_size x max_seq_len
    auto_scheduler: bool

    @staticmethod
    def of(cfg: TidalConfig, args: ModelArgs, kind: Kind) -> MemoryInputs:
        a, seq = cfg.actor, cfg.max_seq_len
        dtype = a.dtype if a.dtype != "auto" else ("bfloat16" if kind == "cuda" else "float32")
        tokens = a.max_tokens_per_micro_batch or a.micro_batch_size * seq
        rows = max(1, tokens // seq)   # sequences of a micro-batch at full width: the count's upper bound
        return MemoryInputs(
            args=args, kind=kind, placement=cfg.placement, actor_tp=a.tensor_parallel_size, backend=a.backend,
            compute_bytes=4 if dtype == "float32" else 2, micro_batch_tokens=tokens,
            microbatches_per_iter=-(-cfg.sequences_per_iter // rows),
            activation_checkpointing=a.activation_checkpointing, offload_optimizer=a.offload_optimizer,
            offload_grad=a.offload_grad, offload_weight=a.offload_weight,
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
            max_running_requests=cfg.rollout.max_running_requests, max_seq_len=seq,
            score_tokens=cfg.algorithm.group_size * seq, auto_scheduler=cfg.cluster.auto_scheduler)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's bytes at its worst phase: `parts` by name ("actor weights", "rollout kv", ...), their sum
    `total`, and `capacity`: the GPU's memory (CUDA) or the host's memory all CPU devices share."""

    device: int
    parts: dict[str, int]
    total: int
    capacity: int

    @staticmethod
    def of(device: int, parts: dict[str, int], capacity: int) -> DeviceMemory:
        kept = {k: v for k, v in parts.items() if v > 0}
        return DeviceMemory(device, kept, sum(kept.values()), capacity)

    def by_component(self) -> dict[str, int]:
        """Bytes per component (the first word of a part's name: actor, kept, rollout, inference, runtime)."""
        out: dict[str, int] = {}
        for name, n in self.parts.items():
            key = name.split()[0]
            out[key] = out.get(key, 0) + n
        return out

    def describe(self) -> str:
        """`device 0 would hold 61.3 GiB (actor weights 32.1, actor grads 32.1, ...)`, largest parts first; parts
        under 1% of the total are left out."""
        big = [(k, v) for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1]) if v * 100 >= self.total]
        parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in big)
        return f"device {self.device} would hold {self.total / GiB:.1f} GiB ({parts})"


@dataclass(frozen=True)
class MemoryPlan:
    """Every device's worst phase. CUDA: each device must fit its GPU. CPU (`pooled`): the devices and the
    driver share the host's memory, so their sum must fit `host_capacity`."""

    kind: Kind
    devices: tuple[DeviceMemory, ...]
    driver_bytes: int               #: CPU: the driver's process and weights, in the same memory (CUDA: 0)
    host_capacity: int              #: CPU: the host memory the plan may fill; CUDA: the smallest GPU's

    @property
    def pooled(self) -> bool:
        return self.kind == "cpu"

    @property
    def total(self) -> int:
        """CPU: the bytes the host holds (every device and the driver); CUDA: the fullest device's."""
        if self.pooled:
            return sum(d.total for d in self.devices) + self.driver_bytes
        return self.worst.total

    @property
    def worst(self) -> DeviceMemory:
        """The fullest device, relative to its capacity."""
        return max(self.devices, key=lambda d: (d.total / max(1, d.capacity), -d.device))

    @property
    def fits(self) -> bool:
        if self.pooled:
            return self.total <= self.host_capacity
        return all(d.total <= d.capacity for d in self.devices)

    def summary(self) -> str:
        """One line for `tidal validate`."""
        w = self.worst
        comps = ", ".join(f"{k} {v / GiB:.2f}" for k, v in w.by_component().items())
        if self.pooled:
            return (f"memory: {len(self.devices)} CPU devices and the driver hold at most {self.total / GiB:.1f} GiB "
                    f"of {self.host_capacity / GiB:.1f} GiB available; the fullest, device {w.device}, "
                    f"{w.total / GiB:.1f} GiB ({comps})")
        return (f"memory: device {w.device} holds at most {w.total / GiB:.1f} GiB of {w.capacity / GiB:.1f} GiB "
                f"({comps})")

    def problem(self) -> str:
        """The numbers of a plan that does not fit."""
        w = self.worst
        if self.pooled:
            return (f"the {len(self.devices)} CPU devices and the driver would hold {self.total / GiB:.1f} GiB "
                    f"together (the driver {self.driver_bytes / GiB:.1f}; {w.describe()}) and this machine has "
                    f"{self.host_capacity / GiB:.1f} GiB available")
        return f"{w.describe()} and has {w.capacity / GiB:.1f} GiB"

    def check(self, fixes: list[tuple[str, str]] | None = None) -> None:
        """Raise a ConfigError when the plan does not fit: `fixes` are (key, advice) pairs, the first of them
        the key named as the field (`memory_fixes` orders them: single changes that fit first)."""
        if self.fits:
            return
        fixes = fixes or [("cluster.component_placement", "more devices, or a smaller model")]
        field_name = fixes[0][0]
        # the refused value is the plan's total: the key named is what to change, not what is wrong
        raise ConfigError(field_name, f"{self.total / GiB:.1f} GiB planned", self.problem(),
                          "; ".join(f"{k}: {v}" for k, v in fixes))


# ---- model arithmetic --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardSizes:
    """Elements of one actor rank: its TP-local parameters and its ZeRO-1 range (exact, `ZeroShape`)."""

    param_total: int
    opt_total: int


def shard_sizes(args: ModelArgs, tp: int, dp: int, t: int, d: int) -> ShardSizes:
    shape = ZeroShape.of(tuple(param_specs(args)), tp, dp, t, d)
    return ShardSizes(shape.param_total, shape.opt_total)


def activation_elements_per_token(args: ModelArgs, tp: int, checkpointing: bool) -> int:
    """Elements the decoder keeps per token for the backward (module doc: A)."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    layer = 5 * h + (3 * q + 3 * kv + 4 * args.intermediate_size) // tp
    if checkpointing:
        return h * args.num_layers + layer
    return layer * args.num_layers


def logit_rows(tokens: int, vocab_local: int) -> int:
    """Rows of logits alive at once: the tokens, cut to `token_logprobs_entropy`'s chunks."""
    chunk = max(64, LOGPROB_CHUNK_ELEMENTS // max(1, vocab_local))
    return min(tokens, chunk)


def local_vocab(args: ModelArgs, tp: int) -> int:
    return -(-args.vocab_size // tp)


# ---- per component -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActorBytes:
    """One actor rank: what it keeps between iters (`state`) and what an iter adds (`train`)."""

    weights: int
    masters: int
    optimizer: int
    grad_buffer: int        #: kept between iters unless offloaded
    grad_accumulator: int   #: the iter's fp32 sum (c < 4), megatron's fp32 grad buffer
    grad_sum: int
    activations: int
    logits: int
    checkpoint: int         #: CPU: a checkpoint's clones of the owned state and their serialized bytes


def actor_bytes(m: MemoryInputs, dp: int, t: int, d: int) -> ActorBytes:
    c, tp, args = m.compute_bytes, m.actor_tp, m.args
    s = shard_sizes(args, tp, dp, t, d)
    n = m.microbatches_per_iter
    mine = -(-n // dp)
    native = m.backend == "native"
    grad_sum = 0
    if native and dp > 1:
        grad_sum = c * (n * s.opt_total + mine * (s.param_total - s.opt_total))
        if m.kind == "cuda":   # NCCL: each of its micro-batches' grads is cloned until the exchange
            grad_sum += c * mine * s.param_total
    if native:
        grad_buffer, accumulator, masters = c * s.param_total, (4 * s.param_total if c < 4 else 0), 4 * s.opt_total
    else:   # megatron-core: DDP's fp32 grad buffer; fp32 main params of their own only over bf16 params
        grad_buffer, accumulator, masters = 4 * s.param_total, 0, (4 * s.opt_total if c < 4 else 0)
    acts = m.micro_batch_tokens * activation_elements_per_token(args, tp, m.activation_checkpointing) * c
    vocab = local_vocab(args, tp)
    # `checkpoint.write_shard`: the owned ranges of param, master and both moments cloned to the host, then
    # serialized to one bytes object: twice those bytes, in the device's memory on CPU (on CUDA: host memory)
    saved = 2 * (c + 12) * s.opt_total if m.kind == "cpu" else 0
    return ActorBytes(c * s.param_total, masters, 8 * s.opt_total, grad_buffer, accumulator, grad_sum, acts,
                      4 * logit_rows(m.micro_batch_tokens, vocab) * vocab, saved)


def actor_state(a: ActorBytes, *, offloaded: bool, m: MemoryInputs) -> dict[str, int]:
    """What the rank keeps on the device between iters; `offloaded`: while an engine generates there, less what
    `actor.offload_*` moves (on CPU host memory is the same memory: only the freed grad buffer is saved)."""
    moves = offloaded and m.kind == "cuda"
    return {
        "actor weights": 0 if moves and m.offload_weight else a.weights,
        "actor masters": 0 if moves and m.offload_optimizer else a.masters,
        "actor optimizer": 0 if moves and m.offload_optimizer else a.optimizer,
        "actor grads": 0 if offloaded and (m.offload_grad or m.offload_weight) else a.grad_buffer,
    }


def actor_training(a: ActorBytes) -> dict[str, int]:
    """What an iter adds to the state."""
    return {"actor grads": a.grad_accumulator, "actor grad sum": a.grad_sum,
            "actor activations": a.activations, "actor logits": a.logits}


def actor_phases(a: ActorBytes, m: MemoryInputs) -> list[dict[str, int]]:
    """The actor alone: an iter, and (CPU) a checkpoint's write."""
    state = actor_state(a, offloaded=False, m=m)
    return [_merge(state, actor_training(a)), _merge(state, {"actor checkpoint": a.checkpoint})]


def weights_bytes(m: MemoryInputs) -> int:
    """An engine's model or a kept replica: the whole model in the compute dtype."""
    return m.compute_bytes * m.args.num_params()


def rollout_parts(m: MemoryInputs, capacity: int) -> dict[str, int]:
    args, c = m.args, m.compute_bytes
    weights = weights_bytes(m)
    rows = m.max_running_requests
    if m.kind == "cuda":
        kv = max(0, int(m.gpu_memory_utilization * capacity) - weights)
    else:
        rows = -(-rows // CPU_ROW_MULTIPLE) * CPU_ROW_MULTIPLE
        blocks = m.max_running_requests * -(-m.max_seq_len // CPU_KV_BLOCK) + 1
        kv = blocks * 2 * args.num_layers * args.num_kv_heads * CPU_KV_BLOCK * args.head_dim * c
    return {"rollout weights": weights, "rollout kv": kv, "rollout logits": 4 * rows * args.vocab_size}


def inference_logits(m: MemoryInputs) -> int:
    return 4 * logit_rows(m.score_tokens, m.args.vocab_size) * m.args.vocab_size


# ---- phases ------------------------------------------------------------------------------------------------------
def _merge(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return out


def _worst(phases: list[dict[str, int]]) -> dict[str, int]:
    return max(phases, key=lambda p: sum(p.values())) if phases else {}


def static_phases(m: MemoryInputs, device: int, capacity: int) -> list[dict[str, int]]:
    """The device's phases of a static placement (module doc): what is resident in each."""
    p = m.placement
    on_a, on_r, on_i = device in p.actor, device in p.rollout, device in p.inference
    layout = Layout(m.actor_tp, len(p.actor) // m.actor_tp, p.actor)
    actor: ActorBytes | None = None
    if on_a:
        t, d = layout.coord(device) or (0, 0)
        actor = actor_bytes(m, layout.dp, t, d)
    rollout = rollout_parts(m, capacity) if on_r else {}
    scorer = {} if (on_r and on_i) or not on_i else {"inference weights": weights_bytes(m)}
    scoring = {"inference logits": inference_logits(m)} if on_i else {}
    if actor is None:
        generate = _merge(rollout, scorer)
        score_kv = {k: v for k, v in rollout.items() if k != "rollout kv"} if on_r else {}
        return [generate, _merge(score_kv, scorer, scoring)] if on_i else [generate]
    kept = {"kept copy": weights_bytes(m)} if (on_r or on_i) else {}
    if on_r:   # generate with the actor handed over, then score, then train with the engines released
        idle = actor_state(actor, offloaded=True, m=m)
        generate = _merge(idle, kept, rollout, scorer)
        phases = [generate, *actor_phases(actor, m)]
        if on_i:
            score_kv = {k: v for k, v in rollout.items() if k != "rollout kv"}
            phases.append(_merge(idle, score_kv, scoring))
        return phases
    state = actor_state(actor, offloaded=False, m=m)
    if on_i:   # scoring and training interleave: both stay resident, their transients one at a time
        train, score = actor_training(actor), scoring
        transient = train if sum(train.values()) >= sum(score.values()) else score
        return [_merge(state, kept, scorer), _merge(state, scorer, transient)] + \
            [_merge(p, scorer) for p in actor_phases(actor, m)]
    return actor_phases(actor, m)


def dynamic_phases(m: MemoryInputs, device: int, capacity: int) -> list[dict[str, int]]:
    """Dynamic scheduling: each role the device may take, one at a time (module doc)."""
    p = m.placement
    widest = p.num_devices // m.actor_tp
    spread = Layout(m.actor_tp, widest, tuple(range(widest * m.actor_tp)))
    if device in p.actor:
        layout = Layout(m.actor_tp, len(p.actor) // m.actor_tp, p.actor)
    elif device in spread.devices:
        layout = spread
    else:
        layout = None
    phases = [rollout_parts(m, capacity), {"inference weights": weights_bytes(m), "inference logits":
                                           inference_logits(m)}]
    if layout is not None:
        t, d = layout.coord(device) or (0, 0)
        a = actor_bytes(m, layout.dp, t, d)
        phases += actor_phases(a, m)
        if m.actor_tp == 1:   # the step end's kept replica, beside the state it was gathered from
            phases.append(_merge(actor_state(a, offloaded=False, m=m), {"kept copy": weights_bytes(m)}))
    return phases


def runtime_bytes(kind: Kind) -> int:
    return CPU_WORKER_BYTES if kind == "cpu" else CUDA_CONTEXT_BYTES


def memory_plan(m: MemoryInputs, capacities: list[int], host_capacity: int | None = None) -> MemoryPlan:
    """The plan of every device (`capacities[d]`: device d's memory; CPU: the host's, for each)."""
    phases = dynamic_phases if m.auto_scheduler else static_phases
    devices = []
    for dev in range(m.placement.num_devices):
        cap = capacities[dev]
        worst = _worst(phases(m, dev, cap))
        devices.append(DeviceMemory.of(dev, {**worst, "runtime": runtime_bytes(m.kind)}, cap))
    driver = CPU_DRIVER_BYTES + 4 * m.args.num_params() if m.kind == "cpu" else 0
    host = host_capacity if host_capacity is not None else min(capacities)
    return MemoryPlan(m.kind, tuple(devices), driver, host)


# ---- fixes -------------------------------------------------------------------------------------------------------
def _candidates(m: MemoryInputs) -> list[tuple[str, str, MemoryInputs | None]]:
    """(key, advice, the inputs with that one change or None where no single value of it is known to help)."""
    p = m.placement
    out: list[tuple[str, str, MemoryInputs | None]] = []
    heads = math.gcd(m.args.num_heads, m.args.num_kv_heads)
    bigger = [tp for tp in range(m.actor_tp + 1, len(p.actor) + 1) if len(p.actor) % tp == 0 and heads % tp == 0]
    if bigger:
        out.append(("actor.tensor_parallel_size", f"{bigger[-1]} (the actor's parameters split over more devices)",
                    replace(m, actor_tp=bigger[-1])))
    shared = set(p.actor) & set(p.rollout)
    if shared and m.kind == "cuda" and not (m.offload_optimizer and m.offload_grad and m.offload_weight):
        out.append(("actor.offload_optimizer", "true, with actor.offload_grad and actor.offload_weight (the actor's "
                    "state in host memory while its devices generate)",
                    replace(m, offload_optimizer=True, offload_grad=True, offload_weight=True)))
    if shared and m.kind == "cpu" and not m.offload_grad:
        out.append(("actor.offload_grad", "true (the grad buffer freed while the actor's devices generate)",
                    replace(m, offload_grad=True)))
    if m.micro_batch_tokens > m.max_seq_len:
        out.append(("actor.max_tokens_per_micro_batch", f"{m.max_seq_len} (fewer activations per micro-batch)",
                    replace(m, micro_batch_tokens=m.max_seq_len,
                            microbatches_per_iter=m.microbatches_per_iter * m.micro_batch_tokens // m.max_seq_len)))
    if m.kind == "cuda" and p.rollout:
        out.append(("rollout.gpu_memory_utilization", "lower (a smaller KV cache)",
                    replace(m, gpu_memory_utilization=0.1)))
    if m.kind == "cpu" and m.max_running_requests > 1:
        out.append(("rollout.max_running_requests", "fewer (a smaller KV cache per rollout device)",
                    replace(m, max_running_requests=1)))
    out.append(("cluster.component_placement", "fewer rollout and inference devices on CPU (each holds a copy of "
                "the weights)" if m.kind == "cpu" else "more actor devices (with a larger actor TP)", None))
    return out


def memory_fixes(m: MemoryInputs, capacities: list[int], host_capacity: int | None,
                 model_key: str) -> list[tuple[str, str]]:
    """Every key that could make the plan fit, those whose one change fits (planned again) first; the model's
    key last, or first when no single change fits and nothing but a smaller model helps."""
    fits, helps = [], []
    for key, advice, changed in _candidates(m):
        if changed is not None and memory_plan(changed, capacities, host_capacity).fits:
            fits.append((key, advice))
        else:
            helps.append((key, advice))
    smaller = (model_key, "a smaller model")
    if fits:
        return fits + helps + [smaller]
    if m.kind == "cpu":   # more CPU devices share the same memory: only less state helps
        return [smaller] + helps
    return helps + [smaller]


# ---- capacity ----------------------------------------------------------------------------------------------------
def host_available_bytes() -> int:
    """Memory this process's machine can still give: MemAvailable, capped by the cgroup's limit (a container's
    `memory.max`; the limit, not the limit less its usage, which counts reclaimable page cache)."""
    avail = _meminfo_available()
    for path in CGROUP_LIMITS:
        limit = _read_limit(path)
        if limit is not None:
            avail = min(avail, limit)
    return avail


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit() or int(text) >= 1 << 60:   # "max", or v1's unlimited sentinel
        return None
    return int(text)


@dataclass(frozen=True)
class Capacity:
    """Each device's memory and, for CPU devices, the host memory they share."""

    per_device: list[int] = field(default_factory=list)
    host: int | None = None


def capacity_of(kind: Kind, num_devices: int) -> Capacity:
    """CUDA: each GPU's total memory (the driver's machine's GPUs 0..n-1); CPU: the host's share for all."""
    if kind == "cuda":
        return Capacity([torch.cuda.get_device_properties(d).total_memory for d in range(num_devices)])
    host = int(CPU_HOST_SHARE * host_available_bytes())
    return Capacity([host] * num_devices, host)


def plan_for(cfg: TidalConfig, args: ModelArgs, kind: Kind, capacity: Capacity | None = None) -> MemoryPlan:
    cap = capacity or capacity_of(kind, cfg.cluster.num_devices)
    return memory_plan(MemoryInputs.of(cfg, args, kind), cap.per_device, cap.host)


def check_memory(cfg: TidalConfig, args: ModelArgs, kind: Kind, capacity: Capacity | None = None) -> MemoryPlan:
    """The run's plan, or a ConfigError when a device (CUDA) or the host (CPU) cannot hold it."""
    cap = capacity or capacity_of(kind, cfg.cluster.num_devices)
    m = MemoryInputs.of(cfg, args, kind)
    plan = memory_plan(m, cap.per_device, cap.host)
    if not plan.fits:
        model_key = "model.path" if cfg.model.path else "model.hidden_size"
        plan.check(memory_fixes(m, cap.per_device, cap.host, model_key))
    return plan
