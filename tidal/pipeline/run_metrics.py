"""What a run logs besides its components' metrics: per-step event aggregates, the events table's columns, and
the devices each component holds over time. Pure functions of the pipeline's event dicts (`Cluster.record`)
and the device ledger's history; `TrainingRun.record` hands their results to the metrics sink.

Per step (`step_event_metrics`), for each event kind of the step, and for reshards, migrations and actions also
in a step without one (zero), so their charts have a point at every step::

    <kind>/count            events of the kind in the step
    <kind>/total_s          their `seconds`, summed (wall seconds; a migration wave's moves ran at once and
                            each carries the wave's seconds: the wave counts once, `tidal.tracking.wave_heads`)
    <kind>/total_bytes      their bytes moved (`bytes`, `bytes_moved` or `kv_bytes`), summed
    <kind>/total_tokens     their `tokens`, summed; likewise `requests`, `groups` (counts)

Per run (`run_figures`), once when it finishes, at its last step, and in summary.json's `figures`::

    run/steps                 the step the run reached (the summary's `steps`; a resumed run counts from 0)
    run/wall_s                wall seconds from `open` to `finish` (restarts included)
    run/mean_step_s           mean of `step/time_s`
    run/idle_fraction         1 - busy / owned device-seconds over the whole run: from the first placement to
                              `finish`, the opening evaluation, evaluations, syncs and checkpoints included; the
                              summary's `device_idle_fraction` and the title of timeline.png
    run/step_idle_fraction    the same over the steps' windows only (each `step/idle_fraction`'s window), so
                              the steps' idle time and the time between them read apart
    run/reshards, run/migrations                        events of the kind (a migration: one move)
    run/heldout_accuracy_start, run/heldout_accuracy_end  held-out accuracy at `open` and after the last step
    run/reward_mean_last      `grpo/reward_mean` of the last step

The idle fractions cover the pipeline since it was last opened (a restart from a checkpoint opens a new one).

An event's other fields (ids, layouts, versions, timestamps, per-event phases) are never metrics: they are
columns or `detail` of the events table (`table_fields`, `tidal.tracking.EVENT_COLUMNS`).

Placement (`placement_changes`): after each batch of ledger transitions (one `DeviceLedger` move), the number of
devices each owner holds. The run logs `devices/<owner>` for the owners whose count changed, stamped with the
transition's wall time, so MLflow's "Time" axis shows the placement over the run::

    t=5.95  placement           devices/free 0, devices/actor 2, devices/rollout 4, devices/inference 2
    t=7.501 inference released  devices/inference 0, devices/moving 2
    t=7.506 its memory freed    devices/moving 0, devices/free 2
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tidal.core.devices import Owner, Transition
from tidal.tracking import wave_heads

#: event field -> the per-step total it adds to (`<kind>/<total>`)
TOTALS = {"seconds": "total_s", "bytes": "total_bytes", "bytes_moved": "total_bytes", "kv_bytes": "total_bytes",
          "tokens": "total_tokens", "requests": "total_requests", "groups": "total_groups"}
#: kinds whose count and totals are logged at every step, zero in a step without one
ALWAYS = {"reshard": ("count", "total_s", "total_bytes"), "migration": ("count", "total_s", "total_bytes"),
          "action": ("count", "total_s")}

#: event kind -> the component it concerns (the events table's `component`)
KIND_COMPONENT = {"reshard": "actor", "iter": "actor", "handover": "actor", "groups": "actor",
                  "checkpoint": "actor", "resume": "actor", "export_hf": "actor", "return_lent": "actor",
                  "migration": "rollout", "weight_sync": "rollout+inference", "restore": "rollout+inference",
                  "decision": "scheduler", "learn": "scheduler", "scheduler_paused": "scheduler"}
#: action -> (component it changes, devices from, devices to): where the action's devices go
ACTION_MOVES = {"ReleaseRollout": ("rollout", "rollout", "free"),
                "ReleaseInference": ("inference", "inference", "free"),
                "ReshardActor": ("actor", "actor", "actor"),
                "LendToRollout": ("actor", "actor", "rollout"),
                "ReturnFromRollout": ("actor", "rollout", "actor"),
                "StartRollout": ("rollout", "free", "rollout"),
                "LendInference": ("inference", "inference", "rollout"),
                "ReturnToInference": ("inference", "rollout", "inference"),
                "MigrateRequests": ("rollout", "rollout", "rollout"),
                "MigrateBatch": ("rollout", "rollout", "rollout")}


def step_event_metrics(events: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """One value per metric for the step whose events these are (see module doc)."""
    events = list(events)
    out: dict[str, float] = {f"{kind}/{agg}": 0.0 for kind, aggs in ALWAYS.items() for agg in aggs}
    # a migration wave's moves ran at once, each record carries the wave's seconds: counted once, as the events
    # table shows them
    heads = wave_heads([(str(ev["kind"]), ev) for ev in events])
    for ev, head in zip(events, heads):
        kind = str(ev["kind"])
        out[f"{kind}/count"] = out.get(f"{kind}/count", 0.0) + 1.0
        for name, total in TOTALS.items():
            v = ev.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and (head or name != "seconds"):
                out[f"{kind}/{total}"] = out.get(f"{kind}/{total}", 0.0) + float(v)
    return out


def run_figures(*, steps: int, wall_s: float, step_seconds: Sequence[float], reshards: int, migrations: int,
                idle_fraction: float, step_idle_fraction: float, heldout_accuracy_start: float,
                heldout_accuracy_end: float, rewards: Sequence[float]) -> dict[str, float]:
    """The run's totals (module doc, "Per run"), logged once when it finishes and written to summary.json under
    `figures`: the same floats in both places, so MLflow's compare view and the summary agree.

    `idle_fraction` is `Timeline.idle_fraction()` (the whole run), `step_idle_fraction`
    `Timeline.steps_idle_fraction()` (the steps' windows only); `step_seconds` and `rewards` hold one value per
    step run in this process (a resumed run's first step is its first)."""
    return {"run/steps": float(steps), "run/wall_s": wall_s,
            "run/mean_step_s": sum(step_seconds) / len(step_seconds) if step_seconds else 0.0,
            "run/idle_fraction": idle_fraction, "run/step_idle_fraction": step_idle_fraction,
            "run/reshards": float(reshards), "run/migrations": float(migrations),
            "run/heldout_accuracy_start": heldout_accuracy_start, "run/heldout_accuracy_end": heldout_accuracy_end,
            "run/reward_mean_last": rewards[-1] if rewards else 0.0}


def _devices_text(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)


def table_fields(ev: Mapping[str, Any]) -> dict[str, Any]:
    """`ev` with the events table's columns filled in: `component`, `what`, `devices`, `from`, `to`, `bytes`,
    `reason` (the fields they come from leave the record, so `detail` does not repeat them)."""
    rec = dict(ev)
    kind = str(rec.get("kind"))
    col: dict[str, Any] = {"component": KIND_COMPONENT.get(kind, "")}
    for name in ("bytes_moved", "kv_bytes"):
        if name in rec and "bytes" not in rec:
            col["bytes"] = rec.pop(name)
    if kind == "reshard":
        col["from"], col["to"] = rec.pop("from_layout", ""), rec.pop("to_layout", "")
    elif kind == "migration":
        col["from"], col["to"] = f"instance {rec.pop('src', '?')}", f"instance {rec.pop('dst', '?')}"
        col["what"] = rec.pop("mode", "")
    elif kind == "action":
        name = str(rec.pop("action", ""))
        col["component"], col["from"], col["to"] = ACTION_MOVES.get(name, ("", "", ""))
        col["what"] = name
    elif kind == "device_failed":   # a lost device (tidal/pipeline/faults.py): out of its role
        col["component"] = col["from"] = rec.pop("role", "")
        col["to"], col["devices"] = "failed", [rec.pop("device", "?")]
    elif kind == "device_recovered":   # its lost work done again on the survivors
        col["component"], col["what"] = rec.pop("role", ""), "work redone"
        col["devices"] = [rec.pop("device", "?")]
    elif kind == "restart":   # the run restarted from a checkpoint (`TrainingRun.restart`): every worker replaced
        col["component"], col["what"] = rec.pop("role", ""), "run restarted"
        col["devices"] = [rec.pop("device", "?")]
        col["from"], col["to"] = f"step {rec.get('step', '?')}", f"step {rec.get('resumed_step', '?')}"
    elif kind == "device_rejoined":   # a replacement worker answers (tidal/pipeline/rejoin.py): back in the free pool
        col["component"], col["from"], col["to"] = rec.pop("role", ""), "failed", "free"
        col["devices"] = [rec.pop("device", "?")]
    elif kind == "decision":
        col["what"] = rec.pop("trigger", "")
        col["reason"] = "; ".join(rec.pop("actions", []))
    elif kind == "handover":
        col["what"] = rec.pop("direction", "")
    elif kind == "return_lent":
        col["from"], col["to"] = "rollout", "actor"
    elif kind == "restore":
        back = {role: rec.pop(role, []) for role in ("rollout", "inference")}
        col["devices"] = sorted(d for ds in back.values() for d in ds)
        col["from"], col["to"] = "free", "+".join(role for role, ds in back.items() if ds)
    elif kind == "weight_sync":
        col["devices"] = sorted(set(rec.get("local", [])) | set(rec.get("remote", [])))
    if isinstance(rec.get("devices"), (list, tuple)):
        col["devices"] = rec.pop("devices")
    if isinstance(col.get("devices"), (list, tuple)):
        col["devices"] = _devices_text(col["devices"])
    return {**rec, **col}


def placement_changes(history: Sequence[Transition], num_devices: int) -> list[tuple[float, dict[str, int]]]:
    """For each move in `history` (its transitions that share a time), the owners whose device count it changed
    and their new counts: [(time, {owner: count}), ...]. The ledger starts with `num_devices` devices FREE."""
    now = {Owner.FREE.value: num_devices}
    out: list[tuple[float, dict[str, int]]] = []
    i = 0
    while i < len(history):
        before, t = dict(now), history[i].time
        while i < len(history) and history[i].time == t:
            tr = history[i]
            now[tr.src.value] = now.get(tr.src.value, 0) - 1
            now[tr.dst.value] = now.get(tr.dst.value, 0) + 1
            i += 1
        changed = {k: v for k, v in now.items() if before.get(k) != v}
        if changed:
            out.append((t, changed))
    return out
