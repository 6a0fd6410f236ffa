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

from dataclasses import asdict
from typing import cast

from tidal.engine.actor import ActorShard
from tidal.engine.checkpoint import (
    CheckpointMeta,
    ShardRecord,
    gather_records,
    load_actor,
    make_manifest,
    tmp_dir,
    write_manifest,
    write_shard,
)
from tidal.engine.layout import Layout
from tidal.workers.roles import actor_of


def actor_save(ctx, dir: str, gen: int, meta: CheckpointMeta) -> dict | None:
    """Actor ranks: write this rank's shard into `<dir>/tmp-<gen>/` (the driver made it); the layout's first
    device also writes the manifest. Collective over the layout. Returns this rank's record (None outside)."""
    shard: ActorShard = actor_of(ctx)
    if shard.state is None:
        return None
    assert meta.step == gen, (meta, gen)  # the generation is named by the step it was taken after
    tmp = tmp_dir(dir, gen)
    mine, error = None, None
    try:
        mine = write_shard(shard, tmp)
    except Exception as e:  # reported through the all-gather so no peer waits for this rank
        error = e
    records = gather_records(shard, mine, error)
    if ctx.rank == shard.layout.devices[0]:
        write_manifest(tmp, make_manifest(shard, meta, records))
    return asdict(cast(ShardRecord, mine))   # in the layout: written, or an error raised by gather_records


def actor_load(ctx, dir: str, layout: Layout) -> dict:
    """Every worker (collective over the world): replace the actor state by the generation at `dir`, resharded
    to `layout`. On any rank's failure every rank keeps its state and raises CheckpointError."""
    shard: ActorShard = actor_of(ctx)
    m = load_actor(shard, dir, layout)
    st = shard.state
    return {"in_layout": st is not None, "optimizer_step": st.step if st else m.optimizer_step,
            "data_cursor": st.data_cursor if st else m.data_cursor, "held_bytes": shard.held_bytes()}
