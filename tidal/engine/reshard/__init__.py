"""Online resharding of the actor between any two layouts `(tp, dp, devices)`: plan, execute, commit.

A reshard is **plan, then execute, then commit**::

    plan = plan_reshard(old, new, specs)     pure: the regions to move, from the layouts and ParamSpecs alone
    execute(plan, ...)                       batched P2P on the world group, per (src, dst) pair, bucketed
    commit (two-phase)                       all-reduce an ok flag; all ok: swap to the new shards;
                                             any failure anywhere: every rank keeps its old shards, drops new

Modules, each importable from outside: `records` (the plan values `ReshardPlan`, `Move`, `MetaMove`;
`ReshardReport` with `metrics()` for the sink; `ReshardError`, rolled back; `FaultInjected` and `PHASES`, fault
hooks for tests), `plan` (`plan_reshard` and the box geometry the checkpoint and Megatron paths share: `shard_box`,
`flat_boxes`, `intersect`, `holdings`, `source_ts`), `execute` (a rank's compiled `Program` of bucketed
messages, run over P2P), `commit` (`reshard_state`: plan, execute, vote, swap or roll back; `prepare_programs`:
every rank's program made once by the driver). `ActorShard.reshard` (tidal/engine/actor.py) drives
`commit.reshard_state`; this package exports the names above.

Imports: torch, torch.distributed and `tidal.engine.layout` / `tidal.engine.optim` only (no Ray, no driver).

A plan is a frozen, hashable value, identical on every rank:
- `Move(spec, what, src, dst, box)`: the region `box` (global coordinates of parameter `spec`) goes from world
  rank `src` to `dst`; `what` is "param" (the compute-dtype weights) or "optim" (the fp32 master weight and both
  Adam moments, which share ownership and so move together). src == dst is a local copy.
- `MetaMove(dst, src, keep_rng)`: the scalars (optimizer step = LR schedule state, data cursor) and, when
  `keep_rng`, the torch generator state of new rank `dst` come from old rank `src`. RNG rule: new rank (t, d)
  keeps the generator of old rank (t, d) when the old layout had those coordinates, else it is seeded from
  `rng_seed(seed, step, t, d)` (tidal/engine/optim.py).

Invariants:
- exact: every byte moves unchanged, so A -> B -> A is bit-identical (parameters, fp32 masters, both Adam
  moments, step, data cursor, the RNG rule), for any layouts, disjoint or overlapping device sets and uneven DP
  sizes included (tests/test_reshard.py, `tidal reshard-check`);
- all or nothing: a failure at any phase on any rank rolls every rank back to its old shards (`ReshardError`);
- every world rank takes part (group creation and the votes are collective over the world); a rank in neither
  layout plans, votes and does nothing else.

Worked example: tp=1,dp=2 on devices (0,1) -> tp=2,dp=1 on (2,3), a parameter of shape (4, 6) split on dim 0.
Old rank 0 owns flat [0, 12) = rows 0-1, rank 1 owns rows 2-3 (optimizer); both hold all rows (param). New rank
2 holds rows 0-1 and owns them, rank 3 rows 2-3: four moves, e.g. `Move(i, "param", 0, 2, ((0, 2), (0, 6)))`,
`Move(i, "optim", 0, 2, ((0, 2), (0, 6)))`, `Move(i, "param", 1, 3, ...)`, ... (param sources are spread over
the DP replicas; a replica on the destination's own device is preferred).
"""

from tidal.engine.reshard.commit import PreparedProgram, prepare_programs, reshard_state
from tidal.engine.reshard.plan import flat_boxes, holdings, intersect, plan_reshard, shard_box, source_ts
from tidal.engine.reshard.records import (
    PHASES,
    FaultInjected,
    MetaMove,
    Move,
    ReshardError,
    ReshardPlan,
    ReshardReport,
)

__all__ = ["PHASES", "Move", "MetaMove", "ReshardPlan", "ReshardReport", "ReshardError", "FaultInjected",
           "plan_reshard", "shard_box", "flat_boxes", "intersect", "holdings", "source_ts",
           "reshard_state", "prepare_programs", "PreparedProgram"]
