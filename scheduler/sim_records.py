"""Records of a simulation (`scheduler.simulator`): events, per-step statistics, the result and its JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class SimEvent:
    time: float
    step: int
    kind: str      #: step_start, step_end, iter_start, iter_done, decide, action
    detail: str


@dataclass(frozen=True)
class StepStats:
    step: int
    time_s: float
    idle_fraction: float
    groups_generated: int
    groups_scored: int
    groups_trained: int
    migrations: int
    groups_migrated: int
    reshards: int
    decisions: int


@dataclass(frozen=True)
class SimResult:
    spec_name: str
    policy: str
    devices: int
    steps: tuple[StepStats, ...]
    total_s: float
    idle_fraction: float
    busy_s: dict
    events: tuple[SimEvent, ...]
    sim_wall_s: float
    seed: int

    @property
    def mean_step_s(self) -> float:
        return self.total_s / max(1, len(self.steps))

    def to_json(self) -> dict:
        return {"spec": self.spec_name, "policy": self.policy, "devices": self.devices, "seed": self.seed,
                "mean_step_s": self.mean_step_s, "total_s": self.total_s, "idle_fraction": self.idle_fraction,
                "busy_device_s": self.busy_s, "sim_wall_s": self.sim_wall_s,
                "steps": [asdict(s) for s in self.steps], "events": [asdict(e) for e in self.events]}
