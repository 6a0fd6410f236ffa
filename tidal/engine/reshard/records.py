"""The values of a reshard: the plan (`ReshardPlan` of `Move`s and `MetaMove`s), what a rank did (`ReshardReport`),
and how it fails (`ReshardError`: rolled back; `FaultInjected`: a test's fault hook). Pure data, no torch."""

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
               "reshard/time_s": self.seconds, "reshard/sent_bytes": float(self.bytes_sent)}
        out.update({f"reshard/{k}_s": v for k, v in self.phase_seconds.items()})
        return out


class ReshardError(RuntimeError):
    """The reshard was rolled back on every rank; the old layout is intact. `report` says where it failed."""

    def __init__(self, report: ReshardReport):
        self.report = report
        super().__init__(f"reshard {report.old} -> {report.new} rolled back: {report.error}")


class FaultInjected(RuntimeError):
    """Raised by test fault hooks (`fault(phase)`) to exercise rollback."""
