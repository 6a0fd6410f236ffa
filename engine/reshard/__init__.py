"""Online resharding of the actor between any two layouts `(tp, dp, devices)`: plan, execute, commit.

A reshard is **plan, then execute, then commit**::

    plan = plan_reshard(old, new, specs)     pure: the regions to move, from the layouts and ParamSpecs alone
    execute(plan, ...)                       batched P2P on the world group, per (src, dst) pair, bucketed
    commit (two-phase)                       all-reduce an ok flag; all ok: swap to the new shards;
                                             any failure anywhere: every rank keeps its old shards, drops new

Entry points: `plan_reshard` and the plan values `ReshardPlan`, `Move`, `MetaMove` (here); `ReshardReport`
(`metrics()` for the sink), `ReshardError` (rolled back), `FaultInjected` and `PHASES` (fault hooks for tests).
`ActorShard.reshard` (engine/actor.py) drives `_commit.reshard_state`; `_plan` and `_execute` are private.

Imports: torch, torch.distributed and `tidal.engine.layout` / `tidal.engine.optim` only (no Ray, no driver).

A plan is a frozen, hashable value, identical on every rank:
- `Move(spec, what, src, dst, box)`: the region `box` (global coordinates of parameter `spec`) goes from world
  rank `src` to `dst`; `what` is "param" (the compute-dtype weights) or "optim" (the fp32 master weight and both
  Adam moments, which share ownership and so move together). src == dst is a local copy.
- `MetaMove(dst, src, keep_rng)`: the scalars (optimizer step = LR schedule state, data cursor) and, when
  `keep_rng`, the torch generator state of new rank `dst` come from old rank `src`. RNG rule: new rank (t, d)
  keeps the generator of old rank (t, d) when the old layout had those coordinates, else it is seeded from
  `rng_seed(seed, step, t, d)` (engine/optim.py).

Invariants:
- exact: every byte moves unchanged, so A -> B -> A is bit-identical (parameters, fp32 masters, both Adam
  moments, step, data cursor, the RNG rule), for any layouts, disjoint or overlapping device sets and uneven DP
  sizes included (tests/test_reshard.py, `tidal reshard-check`);
- all or nothing: a failure at any phase on any rank rolls every rank back to its old shards (`ReshardError`);
- every world rank takes part (group creation and the votes are collective over the world); a rank in neither
  layout plans, votes and does nothing else.

Worked example: tp=1,dp=2 on devices (0,1) -> tp=2,dp=1 on (2,3), a parameter of shape (4, 6) split on dim 0.
Old rank 0 owns flat [0, 12) = rows 0-1, rank 1 owns rows 2-3 (optimizer); both hold all rows (param). New rank
2 holds rows 0-1 and owns them, rank 3 rows 2-3: four moves, e.g. `Move(i, "param", 0, 2, ((0, 2), (0, 6)))`,
`Move(i, "optim", 0, 2, ((0, 2), (0, 6)))`, `Move(i, "param", 1, 3, ...)`, ... (param sources are spread over
the DP replicas; a replica on the destination's own device is preferred).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from tidal.engine.layout import Layout, ParamSpec

PHASES = ("plan", "allocate", "transfer", "commit")


@dataclass(frozen=True)
class Move:
    """Region `box` (per dim half-open, global coordinates) of parameter `spec` goes from `src` to `dst`."""

    spec: int
    what: str
    src: int
    dst: int
    box: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return prod(hi - lo for lo, hi in self.box)


@dataclass(frozen=True)
class MetaMove:
    """New rank `dst` takes step and data cursor (and, if `keep_rng`, the RNG state) from old rank `src`."""

    dst: int
    src: int
    keep_rng: bool


@dataclass(frozen=True)
class ReshardPlan:
    old: Layout
    new: Layout
    specs: tuple[ParamSpec, ...]
    moves: tuple[Move, ...]
    meta: tuple[MetaMove, ...]

    def bytes_moved(self, param_bytes: int, opt_bytes: int = 4) -> int:
        """Bytes that cross between ranks (local copies excluded)."""
        return sum(m.numel * (param_bytes if m.what == "param" else 3 * opt_bytes)
                   for m in self.moves if m.src != m.dst)

    def state_bytes(self, param_bytes: int, opt_bytes: int = 4) -> int:
        """Bytes of actor state in the new layout (params replicated over DP, optimizer state once)."""
        n = sum(s.numel for s in self.specs)
        n_tp_rep = sum(s.numel for s in self.specs if s.tp_dim is None)
        params = n * self.new.dp + n_tp_rep * (self.new.tp - 1) * self.new.dp
        opts = n + n_tp_rep * (self.new.tp - 1)
        return params * param_bytes + 3 * opts * opt_bytes


@dataclass
class ReshardReport:
    """What one rank did in a reshard; `metrics()` gives slash-namespaced values for the metrics sink."""

    old: Layout
    new: Layout
    ok: bool
    bytes_moved: int = 0          # whole plan, across ranks
    bytes_sent: int = 0           # by this rank
    bytes_received: int = 0
    seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prepared: bool = False        # the program came with the call (planned by the caller), not planned here

    def metrics(self) -> dict[str, float]:
        out = {"reshard/ok": float(self.ok), "reshard/bytes": float(self.bytes_moved),
               "reshard/seconds": self.seconds, "reshard/bytes_sent": float(self.bytes_sent)}
        out.update({f"reshard/{k}_s": v for k, v in self.phase_seconds.items()})
        return out


class ReshardError(RuntimeError):
    """The reshard was rolled back on every rank; the old layout is intact. `report` says where it failed."""

    def __init__(self, report: ReshardReport):
        self.report = report
        super().__init__(f"reshard {report.old} -> {report.new} rolled back: {report.error}")


class FaultInjected(RuntimeError):
    """Raised by test fault hooks (`fault(phase)`) to exercise rollback."""


def plan_reshard(old: Layout, new: Layout, specs: tuple[ParamSpec, ...] | list[ParamSpec]) -> ReshardPlan:
    from tidal.engine.reshard._plan import plan_reshard as _impl
    return _impl(old, new, tuple(specs))


__all__ = ["PHASES", "Move", "MetaMove", "ReshardPlan", "ReshardReport", "ReshardError", "FaultInjected",
           "plan_reshard"]
