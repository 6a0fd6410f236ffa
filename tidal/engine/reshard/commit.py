"""Two-phase reshard: every rank keeps its old shards until all ranks hold their new ones.

    all world ranks:  groups(new)            collective, outside the failure domain (pure + deterministic)
                      plan         --fault("plan")
                      allocate     --fault("allocate")    new buffers from the pool, old ones untouched
                      vote 1       all-reduce(min ok)     any failure so far: nobody transfers
                      transfer     --fault("transfer")    old -> new, batched P2P (a local fault finishes the
                                                          protocol it owes first, then votes no)
                                   --fault("commit")
                      vote 2       all-reduce(min ok)
                      ok: return the new state (caller swaps and releases the old into its pool)
                      no: drop the new state on every rank; raise ReshardError (old state intact, usable)

Votes travel on the world group, so ranks in neither layout take part (and do nothing else), unless the caller
passes `vote_group` (the group of the ranks in either layout): then only those ranks take part. A peer that dies
mid-transfer is not covered: its P2P partners would block in the transport (that needs communicator abort and is
left to the worker layer's timeout); every rank-local failure is.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from tidal.engine.layout import Layout
from tidal.engine.optim import BufferPool, ShardState, ZeroShape, rng_seed
from tidal.engine.reshard.execute import Program, compile_program, execute
from tidal.engine.reshard.plan import plan_reshard
from tidal.engine.reshard.records import ReshardError, ReshardPlan, ReshardReport


def _vote(ok: bool, device: torch.device, group=None) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _phase(fault, name: str) -> None:
    if fault is not None:
        fault(name)


def program_for(old: Layout, new: Layout, specs: tuple, rank: int, param_bytes: int,
                bucket_bytes: int) -> tuple[ReshardPlan, Program]:
    """The plan and this rank's program for one layout pair, made once per process per *shape* of the pair.

    Plan and program depend on the device ids only through their order and which ids the two layouts share, so
    the pair is relabelled monotonically onto 0..k-1 (DP 2 on 0-1 -> DP 4 on 0-1,3,5 is DP 2 on 0-1 -> DP 4 on
    0-3), the canonical pair is planned and compiled once (`_canonical_program`, cached), and the program's peers
    are mapped back. Why: planning + compiling a DP 8 -> 2 takes ~40 ms uncapped but 0.3-2.8 s on 0.125-core
    CPU workers (measured on the CPU e2e run, where a dynamic actor meets a new device set most steps)."""
    ids = sorted(set(old.devices) | set(new.devices))
    canon = {d: i for i, d in enumerate(ids)}
    plan, prog = _canonical_program(Layout(old.tp, old.dp, tuple(canon[d] for d in old.devices)),
                                    Layout(new.tp, new.dp, tuple(canon[d] for d in new.devices)),
                                    specs, canon.get(rank, -1), param_bytes, bucket_bytes)
    if ids == list(range(len(ids))):
        return plan, prog
    return plan, Program({ids[p]: m for p, m in prog.sends.items()}, {ids[p]: m for p, m in prog.recvs.items()},
                         prog.local, tuple(ids[p] for p in prog.meta_to),
                         None if prog.meta_from is None else (ids[prog.meta_from[0]], prog.meta_from[1]),
                         prog.rounds)


@dataclass(frozen=True)
class PreparedProgram:
    """One rank's program, made elsewhere (the driver, whose core is not capped) for exactly these inputs. The
    rank checks the inputs against its own before using it, and plans itself on any mismatch."""

    old: Layout
    new: Layout
    rank: int
    param_bytes: int
    bucket_bytes: int
    specs: tuple
    bytes_moved: int
    program: Program

    def fits(self, old: Layout, new: Layout, rank: int, param_bytes: int, bucket_bytes: int, specs: tuple) -> bool:
        return (self.old, self.new, self.rank, self.param_bytes, self.bucket_bytes) == (
            old, new, rank, param_bytes, bucket_bytes) and self.specs == specs


def prepare_programs(old: Layout, new: Layout, specs: tuple, ranks, param_bytes: int,
                     bucket_bytes: int) -> dict[int, PreparedProgram]:
    """Every rank's program for one move (`program_for`, cached), to ship with the reshard call."""
    out = {}
    for r in ranks:
        plan, prog = program_for(old, new, specs, r, param_bytes, bucket_bytes)
        out[r] = PreparedProgram(old, new, r, param_bytes, bucket_bytes, specs, plan.bytes_moved(param_bytes), prog)
    return out


@functools.lru_cache(maxsize=128)
def _canonical_program(old: Layout, new: Layout, specs: tuple, rank: int, param_bytes: int,
                       bucket_bytes: int) -> tuple[ReshardPlan, Program]:
    plan = plan_reshard(old, new, specs)
    return plan, compile_program(plan, rank, param_bytes, bucket_bytes)


def reshard_state(old_state: ShardState | None, old: Layout, new: Layout, specs, *, rank: int,
                  device: torch.device, param_dtype: torch.dtype, pool: BufferPool, seed: int,
                  bucket_bytes: int, fault=None, vote_group=None,
                  prepared: PreparedProgram | None = None) -> tuple[ShardState | None, ReshardReport]:
    """Move `old_state` (None if this rank is not in `old`) to the new layout; see module doc. `vote_group`:
    the group the votes travel on (None: the world; the group of the ranks in `old` or `new` when only those
    ranks take part, see tidal/engine/groups.py)."""
    t0 = time.perf_counter()
    report = ReshardReport(old, new, ok=False)
    new_state = None
    prog, error = _plan_phase(report, old, new, specs, rank, param_dtype, bucket_bytes, fault, prepared)
    t = _lap(report, "plan", t0)
    if error is None:
        new_state, error = _allocate_phase(new, specs, rank, device, param_dtype, pool, fault)
    t = _lap(report, "allocate", t)
    ok = _vote(error is None, device, vote_group)
    t = _lap(report, "vote", t)
    if ok:
        ok, error = _transfer_phase(report, cast(Program, prog), old_state, new_state, t, device=device,
                                    param_dtype=param_dtype, pool=pool, bucket_bytes=bucket_bytes, seed=seed,
                                    fault=fault, vote_group=vote_group)
    report.seconds = time.perf_counter() - t0
    if not ok:
        if new_state is not None:
            new_state.release(None)  # dropped, not pooled: a failed reshard leaves nothing behind
            del new_state
        report.error = error or "another rank voted to abort"
        raise ReshardError(report)
    report.ok = True
    return new_state, report


def _lap(report: ReshardReport, name: str, start: float) -> float:
    """Record phase `name` as running from `start` until now; returns now."""
    now = time.perf_counter()
    report.phase_seconds[name] = now - start
    return now


def _plan_phase(report: ReshardReport, old: Layout, new: Layout, specs, rank: int, param_dtype: torch.dtype,
                bucket_bytes: int, fault, prepared: PreparedProgram | None) -> tuple[Program | None, str | None]:
    """This rank's program: the prepared one where it fits these inputs, else planned here. Records the bytes
    moved on `report`. Returns (program, None), or (None, the error) on a failure."""
    try:
        _phase(fault, "plan")
        param_bytes = torch.empty((), dtype=param_dtype).element_size()
        if prepared is not None and prepared.fits(old, new, rank, param_bytes, bucket_bytes, tuple(specs)):
            prog, report.bytes_moved, report.prepared = prepared.program, prepared.bytes_moved, True
        else:
            plan, prog = program_for(old, new, tuple(specs), rank, param_bytes, bucket_bytes)
            report.bytes_moved = plan.bytes_moved(param_bytes)
    except Exception as e:
        return None, f"plan: {type(e).__name__}: {e}"
    return prog, None


def _allocate_phase(new: Layout, specs, rank: int, device: torch.device, param_dtype: torch.dtype,
                    pool: BufferPool, fault) -> tuple[ShardState | None, str | None]:
    """This rank's new buffers (None where the rank is not in `new`), taken from the pool; the old ones are
    untouched. Returns (state, None), or (None, the error) on a failure."""
    try:
        _phase(fault, "allocate")
        coord = new.coord(rank)
        if coord is not None:
            shape = ZeroShape.of(tuple(specs), new.tp, new.dp, coord[0], coord[1])
            rng = torch.Generator(device)
            return ShardState.allocate(shape, param_dtype, device, pool, rng), None
    except Exception as e:
        return None, f"allocate: {type(e).__name__}: {e}"
    return None, None


def _transfer_phase(report: ReshardReport, prog: Program, old_state: ShardState | None,
                    new_state: ShardState | None, t: float, *, device: torch.device, param_dtype: torch.dtype,
                    pool: BufferPool, bucket_bytes: int, seed: int, fault, vote_group) -> tuple[bool, str | None]:
    """Transfer, then the commit fault and the second vote, both timed from `t`. Returns (every rank voted yes,
    this rank's error or None)."""
    error = None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng_bytes = torch.Generator(device).get_state().numel()
    sent, received, terr = execute(prog, old_state, new_state, device=device, param_dtype=param_dtype,
                                   pool=pool, bucket_bytes=bucket_bytes, seed=seed, fault=fault,
                                   rng_bytes=rng_bytes)
    sync()
    report.bytes_sent, report.bytes_received = sent, received
    if terr is not None:
        error = f"transfer: {terr}"
    t = _lap(report, "transfer", t)
    if error is None:
        try:
            _phase(fault, "commit")
        except Exception as e:
            error = f"commit: {type(e).__name__}: {e}"
    ok = _vote(error is None, device, vote_group)
    _lap(report, "commit", t)
    return ok, error


__all__ = ["PreparedProgram", "prepare_programs", "reshard_state", "rng_seed"]
