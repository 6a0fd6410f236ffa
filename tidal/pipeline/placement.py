"""Where each component of a run is now: one record, owned by the actuator (`tidal.pipeline.actuator.RayActuator`),
handed out as a frozen snapshot. The configured placement (`tidal.core.placement.Placement`) is where a run
starts: the first `Homes`.

    LivePlacement
      actor            the actor's layout now
      rollout          rollout instances now, by device (instance id == device id: rollout TP 1)
      inference        devices scoring now
      lent             actor devices hosting rollout instances (LendToRollout)
      inference_lent   inference devices hosting rollout instances (LendInference)
      homes            where each step starts and its end restores (Homes)

Only the actuator makes a new one (its actions, `restore` at a step's end, `lose` for a device lost mid-step,
`continue_on` after a loss beyond the step); every other module reads the snapshot it is handed. The device
ledger (`tidal.core.devices.DeviceLedger`) says who owns each device; this record says which component instance
runs where, which the ledger cannot (a device lent to rollout is ROLLOUT in the ledger and the actor's here).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.engine.layout import Layout


@dataclass(frozen=True)
class Homes:
    """The placement each step starts on and the step's end restores (changed only by a loss beyond a step)."""

    actor: Layout
    rollout: tuple[int, ...]
    inference: tuple[int, ...]

    @property
    def devices(self) -> frozenset[int]:
        return frozenset((*self.actor.devices, *self.rollout, *self.inference))


@dataclass(frozen=True)
class LivePlacement:
    """Which devices host which component now (module doc)."""

    actor: Layout
    rollout: tuple[int, ...]
    inference: tuple[int, ...]
    lent: frozenset[int]
    inference_lent: tuple[int, ...]
    homes: Homes

    @classmethod
    def at_home(cls, homes: Homes) -> LivePlacement:
        """Every component on its home devices, nothing lent."""
        return cls(homes.actor, homes.rollout, homes.inference, frozenset(), (), homes)

    @property
    def actor_lent_out(self) -> bool:
        """Some of the actor's devices host rollout instances: the actor cannot train until they return."""
        return bool(self.lent & set(self.actor.devices))

    @property
    def engines(self) -> tuple[int, ...]:
        """Devices running a rollout or an inference engine, each once, ascending."""
        return tuple(sorted({*self.rollout, *self.inference}))
