"""Driver side of checkpoints: save a generation of the actor between steps; resume a pipeline from one.

    save(pipe, dir, step)      begin tmp-<step> -> actor_save on the actor's ranks -> commit (rename, marker last,
                               keep the previous generation); returns <dir>/gen-<step>
    resume(pipe, dir) -> step  pick the generation (dir itself, or the newest complete and verified one under it),
                               check it against this run's model (before any worker is touched), load it into
                               the current actor layout on every live rank (resharding on load), restore the
                               driver's position (policy version, data position), and push the loaded weights
                               to rollout and inference; returns the next step to run

What a checkpoint restores: the actor's parameters, fp32 master weights, Adam moments, optimizer step (and so the
LR schedule), RNG states, data cursor, plus the driver's data position and policy version. Rollout and inference
hold no state across steps (weights come from the actor; sampling seeds derive from run seed, step and group id),
so a resumed run trains exactly like an uninterrupted one. Not restored: the scheduler's learned timing
estimates (they change when things run, never what is computed).

Errors are `CheckpointError` (a TidalError: CLI exit 2) naming the file or the model field, raised before any
state is replaced.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.engine.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointMeta,
    Manifest,
    begin,
    check_model,
    commit,
    generations,
    latest,
    read_manifest,
    verify,
)
from tidal.engine.datasets import DataPosition
from tidal.engine.model import ModelArgs, param_specs

if TYPE_CHECKING:
    from tidal.pipeline.driver import Pipeline

log = logging.getLogger("tidal.checkpoint")


def _idle(pipe: Pipeline, what: str) -> None:
    busy = sorted({f.device for f in pipe.cluster.inflight.values()})
    if busy:
        raise RuntimeError(f"{what} between steps only: calls still in flight on devices {busy}")


def save(pipe: Pipeline, dir: str | Path, step: int, keep_last: int = 2) -> Path:
    """Checkpoint the pipeline after `step` completed RL steps (between steps); see module doc."""
    _idle(pipe, "checkpoint")
    dir = Path(dir)
    layout = pipe.placement.actor
    meta = CheckpointMeta(step=step, data_pos=pipe.data_pos.offset, policy_version=pipe.version,
                          data_epoch=pipe.data_pos.epoch)
    t0 = pipe.clock()
    tmp = begin(dir, step)
    g = pipe.group
    try:
        g.gather(pipe.calls.actor.save(layout.devices, str(dir), step, meta))
        final = commit(dir, step, keep_last)
    except BaseException:   # a partial generation is never loadable: do not leave it filling the disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pipe.timeline.add_busy(list(layout.devices), "actor", "checkpoint", t0, pipe.clock())
    pipe.cluster.record("checkpoint", step=step, path=str(final), layout=str(layout),
                        seconds=pipe.clock() - t0)
    return final


def find_generation(dir: str | Path) -> Path:
    """`dir` itself if it is a generation (must verify), else the newest verified generation under it."""
    dir = Path(dir)
    if (dir / MARKER).is_file():
        return dir
    gen = latest(dir)
    if gen is None:
        complete = [path for _, path, ok in generations(dir) if ok]
        if complete:   # the newest one's own error names the file that fails (a garbled manifest, a shard)
            verify(complete[0])
        raise CheckpointError("resume_from", str(dir), "holds no complete, verified checkpoint generation "
                              "(gen-<step>/ with a COMPLETE marker)",
                              "give a checkpoint directory written by `checkpoint`, or one of its gen-* folders")
    return gen


def saved_step(dir: str | Path) -> tuple[Path, int]:
    """The generation a resume from `dir` would load and the step it was saved at (marker-checked manifest)."""
    gen = find_generation(dir)
    return gen, read_manifest(gen).meta.step


def check_resumable(dir: str | Path, args: ModelArgs) -> tuple[Path, Manifest]:
    """The generation to resume and its manifest: marker, checksums and model checked (reads, writes nothing)."""
    gen = find_generation(dir)
    m = verify(gen)
    check_model(m, args, tuple(param_specs(args)), str(gen))
    return gen, m


def resume(pipe: Pipeline, dir: str | Path) -> int:
    """Load a checkpoint into a started pipeline; returns the next step to run (see module doc)."""
    _idle(pipe, "resume")
    gen, m = check_resumable(dir, pipe.spec.args)
    layout = pipe.placement.actor
    t0 = pipe.clock()
    g = pipe.group
    # every rank of the world takes part; a world that lost ranks (tidal.pipeline.survivors) votes over its live ones
    ranks = g.world_ids
    holes = len(ranks) < len(g.device_ids)
    g.gather(pipe.calls.actor.load(ranks, str(gen), layout, ranks if holes else None))
    pipe.data_pos = DataPosition(m.meta.data_epoch, m.meta.data_pos)
    pipe.generations.resumed(m.meta.policy_version, m.meta.step)
    pipe.cluster.record("resume", step=m.meta.step, path=str(gen), saved_layout=str(m.layout),
                        layout=str(layout), version=pipe.version, data_pos=pipe.data_pos.to_json(),
                        seconds=pipe.clock() - t0)
    log.info("resumed from %s (saved at %s, loaded at %s): next step %d", gen, m.layout, layout, m.meta.step)
    return m.meta.step
