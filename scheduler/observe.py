"""The one producer of what a policy sees: `observe(...) -> Signals`.

The real driver (`tidal.pipeline.control`) and the simulator each report what they know in the same typed
form: per rollout instance a row of `RolloutProgress` (sequences started in its engine and the tokens they
generated, sequences given but not started, its counters), plus the inference, actor and device signals.
`observe` turns the rollout rows into estimates with the `LengthModel` (remaining tokens per instance, the
longest remaining sequence per instance and over all of them) and assembles the `Signals`, so both sides
estimate with the same code and a policy cannot tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler.estimate import LengthModel
from scheduler.signals import ActorSignal, DeviceSignal, InferenceSignal, RolloutColumns, RolloutView, Signals


@dataclass(frozen=True, eq=False)
class RolloutProgress:
    """Rollout instances in id order, one entry per instance in every array."""

    ids: np.ndarray
    devices: list[tuple[int, ...]]
    n_devices: np.ndarray          #: len(devices[k]), as a column
    started: np.ndarray            #: sequences in the engine, unfinished (running or waiting)
    progress: np.ndarray           #: tokens those sequences generated so far
    queued: np.ndarray             #: sequences given to the instance (or due to it) and not started
    groups_queued: np.ndarray      #: groups given and not started
    groups_unfinished: np.ndarray  #: groups given and not finished
    running: np.ndarray            #: sequences the instance holds, unfinished
    total: np.ndarray              #: sequences ever given to it this step
    tokens: np.ndarray             #: tokens it generated this step
    token_rate: np.ndarray         #: tokens per second, measured
    lent: np.ndarray               #: it runs on devices lent by the actor


def rollout_columns(r: RolloutProgress, lengths: LengthModel) -> tuple[RolloutColumns, float, float]:
    """The policy's rollout columns, and the longest remaining sequence over all instances and over the started
    ones (see `Signals.rollout_tail_tokens`, `Signals.started_tail_tokens`)."""
    est = lengths.remaining_many(r.started, r.progress, r.queued)
    tail = lengths.tail_many(r.started, r.progress, r.queued)
    tail_all = lengths.tail_total(r.started, r.progress, r.queued)
    tail_started = lengths.tail_total(r.started, r.progress, np.zeros_like(r.queued))
    cols = RolloutColumns(r.ids, r.n_devices, r.groups_queued, r.groups_unfinished, r.running, r.total,
                          np.floor(r.progress), r.token_rate, est, r.lent, tail, np.floor(r.tokens))
    return cols, tail_all, tail_started


def observe(now: float, step: int, trigger: str, rollout: RolloutProgress | None, lengths: LengthModel,
            inference: InferenceSignal, actor: ActorSignal, devices: DeviceSignal, groups_total: int,
            groups_generated: int, all_registered: bool) -> Signals:
    """One decision's `Signals`. `groups_generated` and `inference.groups_finished` are id prefixes: the actor
    trains iter j on the groups [j*G/n, (j+1)*G/n) in id order, so a prefix, not a count, says what it can use."""
    if rollout is not None and len(rollout.ids):
        cols, tail_all, tail_started = rollout_columns(rollout, lengths)
        view: RolloutView | tuple = RolloutView(cols, rollout.devices)
    else:
        cols, tail_all, tail_started, view = None, 0.0, 0.0, ()
    return Signals(now, step, view, inference, actor, devices, groups_total, groups_generated, all_registered,
                   trigger, cols, tail_all, tail_started)
