"""ZeRO-1 AdamW on flat buffers: the shard one rank holds, the LR schedule, exact global-norm clipping.

What one actor rank (t, d) of a layout holds (`ShardState`), all as flat 1-D buffers so that resharding and
gradient sync move contiguous ranges and the update is a handful of elementwise torch ops:

    flat_param  [sum of TP-local numels]       compute dtype (fp32 on CPU, bf16 on GPU), replicated over DP
    master      [sum of owned-range lengths]   fp32 master weights of the owned ranges (tidal/engine/layout.py rule:
    exp_avg     [same]                         the flat range split(numel(TP shard), dp, d) of each parameter)
    exp_avg_sq  [same]
    step, data_cursor, rng                     optimizer steps taken, micro-batches consumed, torch generator

`ZeroShape` is the offset arithmetic of those buffers (pure, cached); parameter i's TP shard is
`flat_param[param_offsets[i]:][:param_numel[i]]` and its owned state is `master[opt_offsets[i]:][:hi - lo]`.

Bit-exactness across DP sizes: the update is elementwise and written as separate single-rounding torch ops
(mul, add, sqrt, div; no fused addcmul/lerp whose SIMD and scalar-tail paths may round differently), so an
element's new value does not depend on which rank owns it or where its range starts. The global grad norm
is summed in fp64 over exact fp64 squares; only the fp64 summation order depends on the partition (relative
error ~1e-16), so the fp32 clip coefficient is the same bits except with probability ~1e-9 per step.

LR schedule: linear warmup over `warmup_iters` steps to `lr`, then cosine to `lr * min_lr_ratio` at
`total_iters`; its only state is `step`, so moving `step` moves the schedule.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from tidal.core.errors import ConfigError
from tidal.engine.layout import Layout, ParamSpec

OPT_KINDS = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW + schedule + clipping hyperparameters (the optimizer part of `tidal.core.config.ActorConfig`)."""

    lr: float = 1e-4                      # peak learning rate
    min_lr_ratio: float = 0.1             # cosine floor as a fraction of lr
    warmup_iters: int = 2                 # linear warmup, in optimizer steps
    total_iters: int = 100                # cosine horizon, in optimizer steps
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0             # decoupled (AdamW)
    grad_clip: float = 1.0                # global L2 norm clip
    on_nonfinite: str = "stop"            # a NaN/inf gradient norm or loss: "stop" (TrainingError) or "skip"

    def __post_init__(self) -> None:
        checks = [("lr", self.lr > 0, "must be > 0"), ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                  ("warmup_iters", self.warmup_iters >= 0, ">= 0"), ("total_iters", self.total_iters >= 1, ">= 1"),
                  ("betas", all(0 <= b < 1 for b in self.betas), "each in [0, 1)"), ("eps", self.eps > 0, "> 0"),
                  ("weight_decay", self.weight_decay >= 0, ">= 0"), ("grad_clip", self.grad_clip > 0, "> 0"),
                  ("on_nonfinite", self.on_nonfinite in ("stop", "skip"), "stop or skip")]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError(f"actor.{name}", getattr(self, name), f"must be {rule}", f"set actor.{name} {rule}")

    @staticmethod
    def from_actor(cfg, total_iters: int) -> OptimConfig:
        """From `tidal.core.config.ActorConfig` (duck-typed) and the run's number of optimizer steps."""
        return OptimConfig(lr=cfg.lr, min_lr_ratio=cfg.min_lr_ratio, warmup_iters=cfg.warmup_iters,
                           total_iters=max(1, total_iters), betas=tuple(cfg.betas), eps=cfg.eps,
                           weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip,
                           on_nonfinite=getattr(cfg, "on_nonfinite", "stop"))


def lr_at(cfg: OptimConfig, step: int) -> float:
    """LR of the update that follows `step` completed steps (step 0 is the first update)."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / cfg.warmup_iters
    span = max(1, cfg.total_iters - cfg.warmup_iters)
    progress = min(1.0, (step - cfg.warmup_iters) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class ZeroShape:
    """Offsets of rank (t, d)'s flat buffers for a parameter inventory (see module doc)."""

    specs: tuple[ParamSpec, ...]
    tp: int
    dp: int
    t: int
    d: int
    param_offsets: tuple[int, ...]
    param_numel: tuple[int, ...]
    owned: tuple[tuple[int, int], ...]     # owned flat range [lo, hi) within each TP-local parameter
    opt_offsets: tuple[int, ...]
    param_total: int
    opt_total: int

    @staticmethod
    @lru_cache(maxsize=256)
    def of(specs: tuple[ParamSpec, ...], tp: int, dp: int, t: int, d: int) -> ZeroShape:
        lay = Layout(tp, dp, tuple(range(tp * dp)))
        p_off, p_n, owned, o_off = [], [], [], []
        p, o = 0, 0
        for s in specs:
            n = math.prod(s.tp_shape(tp, t))
            lo, hi = s.zero_range(lay, t, d)
            p_off.append(p)
            p_n.append(n)
            owned.append((lo, hi))
            o_off.append(o)
            p, o = p + n, o + hi - lo
        return ZeroShape(specs, tp, dp, t, d, tuple(p_off), tuple(p_n), tuple(owned), tuple(o_off), p, o)

    def peer(self, d: int) -> ZeroShape:
        """The shape of DP rank d of the same TP index."""
        return ZeroShape.of(self.specs, self.tp, self.dp, self.t, d)

    def owned_segments(self) -> list[tuple[int, int, int]]:
        """(flat_param offset, opt offset, length) of each non-empty owned range."""
        return [(self.param_offsets[i] + lo, self.opt_offsets[i], hi - lo)
                for i, (lo, hi) in enumerate(self.owned) if hi > lo]


class BufferPool:
    """Free flat buffers kept for reuse: a fresh allocation (page faults) costs more than a CPU transfer.

    `take` returns a prefix view of the smallest free buffer that fits (within 2x, so small requests do not
    pin huge buffers), else a new one; `give` returns a buffer's base. `clear` drops everything.
    """

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        bufs = self._free.setdefault((dtype, torch.device(device)), [])
        fits = [b for b in bufs if numel <= b.numel() <= 2 * max(numel, 1)]
        if fits:
            best = min(fits, key=torch.Tensor.numel)
            del bufs[next(k for k, b in enumerate(bufs) if b is best)]  # identity: == on tensors is elementwise
            return best[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        base = t if t._base is None else t._base
        self._free.setdefault((base.dtype, base.device), []).append(base)

    def bytes(self, device: torch.device | None = None) -> int:
        """Bytes pooled (on `device` only, if given)."""
        return sum(b.numel() * b.element_size() for (_, dev), bs in self._free.items() for b in bs
                   if device is None or dev == device)

    def clear(self) -> None:
        self._free.clear()


_LIVE: weakref.WeakSet[ShardState] = weakref.WeakSet()


def live_states() -> int:
    """ShardStates alive in this process (tests check that a rolled-back reshard leaves none behind)."""
    return len(_LIVE)


@dataclass(eq=False)
class ShardState:
    """Everything one actor rank holds and a reshard moves (see module doc)."""

    shape: ZeroShape
    flat_param: torch.Tensor
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    data_cursor: int
    rng: torch.Generator
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _LIVE.add(self)

    @staticmethod
    def allocate(shape: ZeroShape, dtype: torch.dtype, device: torch.device, pool: BufferPool,
                 rng: torch.Generator) -> ShardState:
        take = pool.take
        flat_param = take(shape.param_total, dtype, device)
        master, exp_avg, exp_avg_sq = (take(shape.opt_total, torch.float32, device) for _ in OPT_KINDS)
        return ShardState(shape, flat_param, master, exp_avg, exp_avg_sq, 0, 0, rng)

    def buffer(self, kind: str) -> torch.Tensor:
        return self.flat_param if kind == "param" else getattr(self, kind)

    def param(self, i: int) -> torch.Tensor:
        """TP-local shard of parameter i, a view of flat_param."""
        s = self.shape
        off = s.param_offsets[i]
        return self.flat_param[off:off + s.param_numel[i]].view(s.specs[i].tp_shape(s.tp, s.t))

    def release(self, pool: BufferPool | None) -> None:
        if pool is not None:
            for k in ("param",) + OPT_KINDS:
                pool.give(self.buffer(k))
        self.flat_param = self.master = self.exp_avg = self.exp_avg_sq = torch.empty(0)

    def nbytes(self) -> int:
        return sum(self.buffer(k).numel() * self.buffer(k).element_size() for k in ("param",) + OPT_KINDS)


def adamw_update(state: ShardState, grad: torch.Tensor, lr: float, cfg: OptimConfig) -> None:
    """One AdamW step on the owned ranges; `grad` is fp32 [opt_total], already clipped. Increments step."""
    step = state.step + 1
    b1, b2 = cfg.betas
    p, m, v = state.master, state.exp_avg, state.exp_avg_sq
    if cfg.weight_decay:
        p.mul_(1.0 - lr * cfg.weight_decay)
    m.mul_(b1).add_(grad * (1.0 - b1))
    v.mul_(b2).add_((grad * grad).mul_(1.0 - b2))
    denom = v.sqrt().div_(math.sqrt(1.0 - b2 ** step)).add_(cfg.eps)
    p.sub_((m / denom).mul_(lr / (1.0 - b1 ** step)))
    state.step = step


def clip_coefficient(sumsq_fp64: float, cfg: OptimConfig) -> float | None:
    """Scale for the grads given the global sum of squares, or None when no clipping is needed."""
    norm = math.sqrt(sumsq_fp64)
    if norm <= cfg.grad_clip:
        return None
    return float(torch.tensor(cfg.grad_clip / (norm + 1e-6), dtype=torch.float32).item())


def rng_seed(seed: int, step: int, t: int, d: int) -> int:
    """Deterministic generator seed of rank (t, d) created fresh at `step` (see docs/resharding.md)."""
    x = seed & 0xFFFFFFFF
    for v in (step, t, d):
        x = (x * 1_000_003 + v + 1) % (1 << 61)
    return x
