"""Worker-side checkpoint roles: every actor rank writes its own shard; every worker takes part in a load.

Called by the driver (`tidal.pipeline.checkpointing`) through `WorkerGroup.submit(device,
"tidal.workers.roles_ckpt:fn", ...)` between steps, when no other call is in flight on the actor's devices::

    driver                         actor ranks (layout devices)                     driver
    begin(dir, step) --> actor_save: write_shard, fsync; all-gather records;  --> commit: rename tmp -> gen,
                                     layout's first device writes manifest.json       COMPLETE marker last

    driver verifies gen  --> actor_load on EVERY worker (collective over the world, like a reshard): each rank
                             of `layout` reads the regions it owns from the saved shards; all vote; all swap

Only paths, layouts and small records cross the driver boundary; tensors stay on the workers and the disk.
"""

from __future__ import annotations

from tidal.engine.backends.protocol import CheckpointLoad
from tidal.engine.checkpoint import CheckpointMeta, ShardRecord, tmp_dir
from tidal.engine.layout import Layout
from tidal.workers.device_worker import WorkerContext
from tidal.workers.roles import actor_of


def actor_save(ctx: WorkerContext, dir: str, gen: int, meta: CheckpointMeta) -> ShardRecord | None:
    """Actor ranks: write this rank's shard into `<dir>/tmp-<gen>/` (the driver made it); the layout's first
    device also writes the manifest (`ActorBackend.save_checkpoint`, the native format for every backend).
    Collective over the layout. Returns this rank's record (None outside)."""
    assert meta.step == gen, (meta, gen)  # the generation is named by the step it was taken after
    return actor_of(ctx).save_checkpoint(tmp_dir(dir, gen), meta)


def actor_load(ctx: WorkerContext, dir: str, layout: Layout, ranks: tuple[int, ...] | None = None) -> CheckpointLoad:
    """Every worker (collective over the world; over `ranks`, the live ones, when the world lost some): replace
    the actor state by the generation at `dir`, resharded to `layout`. On any rank's failure every rank keeps its
    state and raises CheckpointError."""
    return actor_of(ctx).load_checkpoint(dir, layout, ranks)
