"""Database rows for a run: one per step, reshard, migration, scheduler decision/action, fault and device move.

The pipeline and the reconciler produce plain event dicts (`Cluster.record`); this is the one place that turns
them into rows (via `db.repository`, in one transaction per step).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from db import repository as repo
from db.session import session_scope
from tidal.core.devices import Transition

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from tidal.pipeline.driver import StepResult

#: pipeline event kind -> `fault_events.kind` (tidal.pipeline.faults, tidal.pipeline.rejoin)
FAULTS = {"device_failed": "failed", "device_recovered": "recovered", "device_rejoined": "rejoined"}


def _layout(text: str) -> dict[str, int | str]:
    out: dict[str, int | str] = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k] = int(v) if v.isdigit() else v
    return out


class DbRecorder:
    def __init__(self, engine: Engine, run_id: int, policy: str):
        self.engine, self.run_id, self.policy = engine, run_id, policy
        self._moves_written = 0   # rows of the current ledger's (append-only) history already recorded

    def step(self, step: int, res: StepResult, metrics: Mapping[str, float]) -> None:
        with session_scope(self.engine) as s:
            repo.add_step(s, self.run_id, step=step, step_seconds=res.seconds, phase_seconds=res.phase_seconds,
                          reward=metrics.get("grpo/reward_mean"), eval_accuracy=metrics.get("eval/heldout_accuracy"),
                          device_idle_fraction=metrics.get("step/idle_fraction"))
            for ev in res.events:
                kind = ev["kind"]
                if kind == "reshard":
                    repo.record_reshard(s, self.run_id, step=ev["step"], iter=ev["iter"],
                                        from_layout=_layout(ev["from_layout"]), to_layout=_layout(ev["to_layout"]),
                                        devices=ev["devices"], bytes_moved=int(ev["bytes_moved"]),
                                        seconds=float(ev["seconds"]), ok=True, reason="scheduler")
                elif kind == "migration":
                    repo.record_migration(s, self.run_id, step=ev["step"], request_id=f"{ev['requests']} requests",
                                          group_id=f"{ev['groups']} groups", source_instance=ev["src"],
                                          target_instance=ev["dst"], mode=ev["mode"], tokens=0,
                                          bytes=int(ev["kv_bytes"]), seconds=float(ev["seconds"]), ok=True,
                                          reason="scheduler")
                elif kind in FAULTS:
                    repo.record_fault(s, self.run_id, step=ev["step"], time=float(ev["time"]), kind=FAULTS[kind],
                                      device_id=ev["device"], role=ev["role"], reason=ev.get("reason", ""),
                                      seconds=float(ev["seconds"]), bytes=int(ev.get("bytes", 0)),
                                      groups=int(ev.get("groups", 0)), tokens=int(ev.get("tokens", 0)))
                elif kind in ("decision", "action"):
                    repo.record_scheduler_event(
                        s, self.run_id, step=ev["step"], time=float(ev["time"]), policy=self.policy, kind=kind,
                        devices=ev.get("devices", []) if isinstance(ev.get("devices"), list) else [],
                        reason="; ".join(ev["actions"]) if kind == "decision" else ev.get("reason", ""),
                        iter=ev.get("iter"), action_type=ev.get("action"),
                        outcome=None if kind == "decision"
                        else ("ok" if ev.get("ok") else f"failed: {ev.get('error')}"))

    def transitions(self, history: Iterable[Transition]) -> None:
        """The ledger's moves not recorded yet."""
        new = list(history)[self._moves_written:]
        self._moves_written += len(new)
        with session_scope(self.engine) as s:
            repo.record_transitions(s, self.run_id, new)

    def restart(self, failed: dict[str, Any], restarted: dict[str, Any], history: Iterable[Transition],
                new_ledger: bool) -> None:
        """A run resumed from a checkpoint in process: the ledger's moves so far (with `new_ledger`, the lost
        pipeline's whole history: the next pipeline's ledger starts anew), the failure and the recovery as fault
        rows (`failed`, `recovered`), and the steps it will run again forgotten."""
        self.transitions(history)
        if new_ledger:
            self._moves_written = 0
        with session_scope(self.engine) as s:
            for ev, kind in ((failed, "failed"), (restarted, "recovered")):
                repo.record_fault(s, self.run_id, step=ev["step"], time=float(ev["time"]), kind=kind,
                                  device_id=ev["device"], role=ev["role"], reason=ev["reason"],
                                  seconds=float(ev["seconds"]))
            repo.forget_steps_from(s, self.run_id, restarted["resumed_step"])
