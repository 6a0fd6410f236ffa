"""A device lost beyond what its step absorbs: the run goes on with the workers it still has, from the newest state.

A lost rollout or inference device costs only its work (`tidal.pipeline.faults`). Any other loss (an actor device,
any device outside a step's streaming loop: the weight sync, a checkpoint write, the host copy) ends the step.
Then, in the same process and with the same workers::

    run_training: WorkerDied ─► TrainingRun.recover ─► continue_on_survivors(pipe, died, generation)
      1. the device FAILED in the ledger and retired from the group. Its rank stays a hole in the world: process
         groups are made by the live ranks alone (they call `new_group` in the same order; without a barrier,
         torch names a group by that order, so the dead rank is never waited for), and it is in none of them
      2. the step abandoned: rollout slices interrupted, every live worker's calls waited for
         (`WorkerGroup.quiesce`: collectives with the dead rank fail on its closed sockets; a worker still busy
         after `cluster.failure_timeout_s` is lost too), every engine dropped (`roles.abandon_engines`)
      3. the placement without it (`survivor_placement`, a pure decision): below
      4. the newest state kept (the host copy of `actor.redundancy: host`, or the last checkpoint) loaded into
         that layout on every live rank, two-phase, voted over the live ranks (`tidal.pipeline.checkpointing.resume`),
         the engines started on its weights, the data position and policy version restored; the step runs again
      5. with `cluster.replace_failed` a replacement worker is asked for; it rejoins the free pool when it answers

The placement after a loss (`survivor_placement`): the actor keeps its surviving devices in whole TP groups, at
its TP size (survivors outside whole groups go to rollout). When no whole TP group survives it takes spare
devices: free ones first, then rollout's, then inference's, highest id first, each engine component keeping one;
when even that cannot fill a group, the largest smaller TP size the model splits by. Rollout and inference keep
their survivors. That placement is what later steps start on and what the step end restores.

Bit for bit: the state loaded is the one the lost step started from, the step's samples draw from generators
seeded by (run seed, step, group id, sample index), and the actor's update does not depend on its layout (see
`tidal.pipeline.driver`), so on CPU the run ends with the weights of a run without the fault (tested,
tests/test_survivors.py). Not here: the megatron backend (its groups span the whole world) and shared placements
(their hand-overs follow the configured placement) restart with new workers (`TrainingRun.restart`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidal.core.devices import Owner
from tidal.engine.groups import growth_rank_sets
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, check_tp
from tidal.pipeline.checkpointing import resume
from tidal.pipeline.placement import Homes
from tidal.workers.errors import WorkerDied
from tidal.workers.roles_rollout import ROLLOUT_INTERRUPT

if TYPE_CHECKING:
    from tidal.pipeline.driver import Pipeline

log = logging.getLogger("tidal.pipeline")


class NoSurvivors(RuntimeError):
    """The survivors cannot hold every component (the last device of one is gone): the run restarts instead."""


@dataclass(frozen=True)
class SurvivorPlacement:
    """Where each component runs after a loss: `borrowed` are engine or free devices the actor took, `freed`
    surviving actor devices outside whole TP groups (given to rollout)."""

    layout: Layout
    rollout: tuple[int, ...]
    inference: tuple[int, ...]
    borrowed: tuple[int, ...]
    freed: tuple[int, ...]


def survivor_placement(layout: Layout, rollout: Sequence[int], inference: Sequence[int], lost: set[int],
                       free: Sequence[int], tp_fits: Callable[[int], bool],
                       actor_capable: Callable[[int], bool] = lambda d: True) -> SurvivorPlacement:
    """The placement without the `lost` devices (module doc). `free`: live devices in no role; `tp_fits(t)`:
    whether the model splits at TP t; `actor_capable(d)`: whether device d can hold an actor shard (a rank of
    the world). Raises NoSurvivors when rollout or inference has no device left, or no device can hold the actor.

    >>> survivor_placement(Layout(1, 2, (0, 1)), (2, 3), (4, 5), {0}, (), lambda t: True)
    SurvivorPlacement(layout=Layout(tp=1, dp=1, devices=(1,)), rollout=(2, 3), inference=(4, 5), borrowed=(), freed=())
    >>> survivor_placement(Layout(1, 1, (0,)), (1, 2), (3, 4), {0}, (), lambda t: True).layout.devices
    (2,)
    """
    survivors = sorted(d for d in layout.devices if d not in lost)
    rollout_left = [d for d in rollout if d not in lost]
    inference_left = [d for d in inference if d not in lost]
    if not rollout_left or not inference_left:
        gone = "rollout" if not rollout_left else "inference"
        raise NoSurvivors(f"{gone} has no device left")
    # spares, in the order the actor takes them: free devices, then each engine component's highest ids, each
    # component keeping one device
    spares = [d for d in free if d not in lost and actor_capable(d)]
    for comp in (rollout_left, inference_left):
        spares += [d for d in sorted(comp, reverse=True)[:len(comp) - 1] if actor_capable(d)]
    devices: tuple[int, ...]
    freed: tuple[int, ...]
    borrowed: tuple[int, ...]
    for tp in range(layout.tp, 0, -1):
        if not tp_fits(tp):
            continue
        if len(survivors) >= tp:
            dp = len(survivors) // tp
            devices, freed, borrowed = tuple(survivors[:dp * tp]), tuple(survivors[dp * tp:]), ()
            break
        need = tp - len(survivors)
        if need <= len(spares):
            devices, freed, borrowed = tuple(sorted(survivors + spares[:need])), (), tuple(spares[:need])
            break
    else:
        raise NoSurvivors(f"no device left for the actor (survivors {survivors}, spares {spares})")
    return SurvivorPlacement(Layout(tp, len(devices) // tp, devices),
                             tuple(sorted(d for d in {*rollout_left, *freed} if d not in borrowed)),
                             tuple(d for d in inference_left if d not in borrowed), borrowed, freed)


def refusal(pipe: Pipeline) -> str | None:
    """Why this run cannot continue on its survivors (it restarts with new workers instead), or None."""
    if pipe.spec.backend != "native":
        return f"actor.backend={pipe.spec.backend}: its process groups span the whole world"
    if pipe.sharing.any:
        return "a shared placement: its hand-overs follow the configured devices"
    return None


def continue_on_survivors(pipe: Pipeline, died: WorkerDied, generation: Path) -> dict[str, Any]:
    """Steps 1-5 of the module doc on pipeline `pipe` for the loss `died`, from `generation` (a checkpoint
    generation or a host copy). Returns the placement, what was abandoned, and seconds; the caller runs the step
    `resumed_step` again. Raises NoSurvivors (nothing changed but the loss itself) when the survivors cannot hold
    every component."""
    c, g, ledger, actuator = pipe.cluster, pipe.group, pipe.ledger, pipe.actuator
    cfg = pipe.cfg
    t0 = pipe.clock()
    failures = [ledger.fail(died.device_id, died.reason)] if ledger.owner(died.device_id) is not Owner.FAILED else []
    g.retire(died.device_id)
    # 2. the step abandoned
    slices = {d: seq for d, seq in c.slice_seq.items() if d in g.live_ids}
    if slices:
        g.interrupt(slices, ROLLOUT_INTERRUPT)
    calls_lost = len(c.inflight)
    for d in g.quiesce(g.live_ids, cfg.cluster.failure_timeout_s):   # hung: lost as well
        failures.append(ledger.fail(d, "still busy after the step was abandoned"))
        g.retire(d)
    c.inflight.clear()
    actuator.abandon_step()
    pipe.generations.forget()
    if pipe.ahead is not None:
        pipe.ahead.clear()   # the engines holding later steps' groups are dropped: drawn again when dealt
    g.gather(c.endpoints.worker.abandon_engines(g.live_ids))
    abandon_s = pipe.clock() - t0
    # 3. the placement without the lost devices
    lost = set(ledger.owned(Owner.FAILED))
    world = set(g.world_ids)
    homes = actuator.placement.homes
    free = [d for d in g.live_ids if d not in homes.devices]
    args = pipe.spec.args
    old = homes.actor
    place = survivor_placement(old, homes.rollout, homes.inference, lost, free,
                               lambda t: _splits(args, t), lambda d: d in world)
    actuator.continue_on(Homes(place.layout, place.rollout, place.inference),
                         f"placement without devices {sorted(lost)}")
    # 4. the newest state, on the new layout; the engines on its weights
    t_load = pipe.clock()
    step = resume(pipe, generation)
    load_s = pipe.clock() - t_load
    if cfg.cluster.auto_scheduler:   # the groups the actor grows through from its new layout, as at start
        sets = growth_rank_sets(place.layout, g.world_ids)
        if sets:
            g.gather(c.endpoints.actor.make_groups(g.world_ids, sets))
            actuator.known_rank_sets(sets)
    actuator.known_rank_sets([place.layout.devices])
    # 5. replacements
    if cfg.cluster.replace_failed:
        for f in failures:
            pipe.rejoin.start(f)
    now = pipe.clock()
    for f in failures:
        c.timeline.add_recovery(f.device, f"continued on survivors {now - f.time:.2f}s", f.time, now)
    loaded = sum(f.stat().st_size for f in Path(generation).rglob("*") if f.is_file())
    record = {"layout_from": str(old), "layout_to": str(place.layout), "borrowed": list(place.borrowed),
              "freed": list(place.freed), "rollout": list(place.rollout), "inference": list(place.inference),
              "lost": sorted(f.device for f in failures), "calls_lost": calls_lost, "abandon_s": abandon_s,
              "load_s": load_s, "bytes": loaded, "resumed_step": step, "seconds": now - t0}
    c.record("continue_on_survivors", step=step, **record)
    log.warning("device %d lost (%s): continuing on the survivors, actor %s -> %s, from %s (step %d) in %.2fs",
                died.device_id, died.reason, old, place.layout, generation, step, now - t0)
    return record


def _splits(args: ModelArgs, tp: int) -> bool:
    try:
        check_tp(args, tp)
    except Exception:  # noqa: BLE001 - a LayoutError: that TP size does not split the model
        return False
    return True
