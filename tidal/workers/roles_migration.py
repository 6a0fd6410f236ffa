"""Worker-side migration of a rollout instance's work: freeze, move and settle groups and their requests.

One wave of moves (`tidal.pipeline.actuator`), one call per device and phase, every device in the wave's move
order::

    sources  rollout_export_many(counts, routes)   freeze the next groups per move; requests' KV stays in place
                                                   in the source's blocks (a `CudaIpcTensor` of the pool where the
                                                   move's route is ipc); returns small packages
             rollout_send_kv(sends)                p2p moves: per move the target's wanted mask, then the wanted
                                                   states' blocks (`transfer.send_blocks`)
    targets  rollout_import_from(sources)          per move: the package (a small object-store value), the
                                                   engine's staged import (it takes blocks), the KV received (p2p)
                                                   or copied from the mapped pool (ipc), then activated
    sources  rollout_settle_exports(receipts, ok)  commit (the blocks are freed) or cancel (the requests resume)

A request is active in one engine at every moment: the target activates only once its KV landed, the source
forgets its frozen copy only at the commit, and a failure before that leaves it whole on the source. A move
whose ends are not in one world (a replacement worker) takes route `reprefill`: its states travel without KV
and the target rebuilds it from the tokens (exact). No KV cache goes through the object store.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from tidal.engine.transfer import copy_blocks, open_shared, recv_blocks, recv_ints, send_blocks, send_ints, share
from tidal.workers.device_worker import WorkerContext
from tidal.workers.messages import ExportReceipt, KVRoute, MigrationPackage, MoveResult, PackageRef
from tidal.workers.roles import RolloutSlot, rollout_slot
from tidal.workers.rollout_instance import PromptGroup

if TYPE_CHECKING:
    from ray import ObjectRef


def rollout_export(ctx: WorkerContext, count: int | None = None, route: KVRoute = "p2p") -> MigrationPackage:
    """Phase 1 of moving work away: freeze the last `count` unfinished groups (None: all) and return the package.

    Order (the scheduler's rule): groups not started go first (from the back of the local queue), then the most
    recently admitted open groups, whose finished samples travel as results and running requests as engine
    states whose KV stays in this engine's blocks until the settle (module doc)."""
    r = rollout_slot(ctx)
    inst = r.inst
    want = float("inf") if count is None else count
    queued: list[PromptGroup] = []
    while len(queued) < want and r.queue.remaining():
        queued.append(r.queue.pop_back())
    # groups frozen by an export not yet committed or cancelled are not offered again: several exports from one
    # source may be in flight at once (the actuator's migration waves), each taking the next groups
    open_ids = [gid for gid in reversed(inst.group_ids()) if gid not in r.exporting]
    open_ids = open_ids[:max(0, int(min(want, 1 << 30)) - len(queued))]
    r.exporting.update(open_ids)
    open_groups = {gid: inst.group_snapshot(gid) for gid in open_ids}
    ids = [rid for rid in r.engine.request_ids() if int(rid.split("/")[1][1:]) in open_groups]
    states = r.engine.export_state(ids, in_place=True) if ids else []
    if route == "reprefill":   # the target rebuilds the KV from the tokens
        states = [st.without_kv() for st in states]
    in_blocks = any(st.kv_blocks is not None for st in states)
    pool = share(r.engine.kv_pool) if route == "ipc" and in_blocks else None
    return MigrationPackage(tuple(queued), open_groups, tuple(states), pool)


def rollout_export_many(ctx: WorkerContext, counts: Sequence[int | None],
                        routes: Sequence[KVRoute] | None = None) -> list[MigrationPackage]:
    """`rollout_export` for each count, in order (each takes the next groups: the same as separate calls), the
    packages kept for this wave's `rollout_send_kv`."""
    r = rollout_slot(ctx)
    r.outbox = None
    routes = list(routes) if routes is not None else ["p2p"] * len(counts)
    out = [rollout_export(ctx, c, route) for c, route in zip(counts, routes, strict=True)]
    r.outbox = out
    return out


def _streams(pkg: MigrationPackage, route: KVRoute) -> bool:
    """Whether a move's KV streams point to point (both ends decide it alike from the package)."""
    return route == "p2p" and any(st.kv_blocks is not None for st in pkg.states)


def rollout_send_kv(ctx: WorkerContext, sends: Sequence[tuple[int, int]]) -> int:
    """Source side of the wave's p2p moves, in the wave's move order: for (package k of the last
    `rollout_export_many`, target device), the target's wanted mask, then the blocks of each wanted state.
    Returns the bytes sent."""
    r = rollout_slot(ctx)
    if r.outbox is None:   # the export failed: its targets know it from the export's result
        return 0
    sent = 0
    for k, dst in sends:
        pkg = r.outbox[k]
        if not _streams(pkg, "p2p"):
            continue
        rank = ctx.rank_of(dst)
        wanted = recv_ints(len(pkg.states), rank, ctx.group)
        for st, w in zip(pkg.states, wanted):
            if w:
                sent += send_blocks(r.engine.kv_pool, cast(tuple[int, ...], st.kv_blocks), rank, ctx.group)
    return sent


def rollout_import(ctx: WorkerContext, package: MigrationPackage, source: int | None = None,
                   route: KVRoute = "p2p") -> int:
    """Phase 2 on the target: take the package over (all or nothing), its KV received from device `source` by
    `route`; returns requests imported."""
    states = list(package.states)
    ids = [st.request_id for st in states]
    stream = _streams(package, route)
    try:
        r = rollout_slot(ctx)
        if states:
            r.engine.import_state(states, staged=True)
    except Exception:
        if stream:   # the source waits for the mask: nothing wanted
            send_ints([0] * len(states), ctx.rank_of(cast(int, source)), ctx.group)
        raise
    try:
        _land_kv(ctx, r, package, route, source)
    except Exception:
        r.engine.abort(ids)   # the staged requests and their blocks go; the source resumes them at the cancel
        raise
    r.engine.activate(ids)
    for group, results in package.open.values():
        r.inst.adopt_group(group, results)
    r.queue.extend(package.queued)
    r.inst.reopen()
    return len(states)


def _land_kv(ctx: WorkerContext, r: RolloutSlot, package: MigrationPackage, route: KVRoute,
             source: int | None) -> None:
    """The staged states' KV into the blocks the engine took for them (a state that found none re-prefills)."""
    into = [r.engine.kv_destination(st.request_id) if st.kv_blocks is not None else None for st in package.states]
    if _streams(package, route):
        rank = ctx.rank_of(cast(int, source))
        send_ints([int(b is not None) for b in into], rank, ctx.group)
        for blocks in into:
            if blocks is not None:
                recv_blocks(r.engine.kv_pool, blocks, rank, ctx.group)
    elif route == "ipc" and package.kv_pool is not None and any(b is not None for b in into):
        src_pool = open_shared(package.kv_pool)
        for st, blocks in zip(package.states, into):
            if blocks is not None:
                copy_blocks(src_pool, cast(tuple[int, ...], st.kv_blocks), r.engine.kv_pool, blocks)
        torch.cuda.current_stream().synchronize()   # the copies read the source's memory: done before the receipt
        del src_pool


def rollout_commit_export(ctx: WorkerContext, receipt: ExportReceipt) -> None:
    """Phase 2 on the source, after the target imported: forget the moved work (its KV blocks are freed)."""
    r = rollout_slot(ctx)
    if receipt.request_ids:
        r.engine.commit_export(list(receipt.request_ids))
    for gid in receipt.open:
        r.inst.drop_group(gid)
        r.exporting.discard(gid)


def rollout_cancel_export(ctx: WorkerContext, receipt: ExportReceipt) -> None:
    """The target failed: unfreeze everything here and put the queued groups back."""
    r = rollout_slot(ctx)
    if receipt.request_ids:
        r.engine.cancel_export(list(receipt.request_ids))
    r.exporting.difference_update(receipt.open)
    r.queue.extend(receipt.queued)
    r.inst.reopen()


def rollout_import_from(ctx: WorkerContext, sources: Sequence[PackageRef]) -> list[MoveResult]:
    """`rollout_import` of each package, in the wave's order: package `k` of the list its source's
    `rollout_export_many` returned (`ref`, that call's result: small records, fetched by the target itself so
    the driver does not wait for the exports), its KV from the source by the move's route. A failed import is
    reported (its error, and the receipt its source cancels with), not raised, and leaves the others imported
    (each import is all or nothing); an export that failed fails its moves here (`exported` False, no receipt:
    nothing to settle)."""
    import ray
    t0 = time.perf_counter()
    got: dict[ObjectRef[list[MigrationPackage]], list[MigrationPackage] | Exception] = {}
    for src in sources:
        if src.ref not in got:
            try:
                got[src.ref] = ray.get(src.ref)
            except Exception as err:  # noqa: BLE001 - the source's export failed: its moves fail, the others go on
                got[src.ref] = err
    fetch_s = time.perf_counter() - t0   # waiting for the exports and fetching them (the driver sees only the sum)
    out = []
    for src in sources:
        exported = got[src.ref]
        if isinstance(exported, Exception):
            out.append(MoveResult(False, exported=False, error=f"export: {type(exported).__name__}: {exported}"))
            continue
        pkg = exported[src.index]
        summary, receipt = pkg.summary(), pkg.receipt()
        try:
            rollout_import(ctx, pkg, src.source, src.route)
            out.append(MoveResult(True, summary, receipt))
        except Exception as err:  # noqa: BLE001 - reported per move; the driver cancels that move's export
            out.append(MoveResult(False, receipt=receipt, error=f"{type(err).__name__}: {err}"))
    import_s = time.perf_counter() - t0 - fetch_s
    return [res.timed(fetch_s, import_s) for res in out]


def rollout_settle_exports(ctx: WorkerContext, receipts: Sequence[ExportReceipt], commit: Sequence[bool]) -> None:
    """Commit (the target imported) or cancel (it failed) each export, in order."""
    for rec, ok in zip(receipts, commit, strict=True):
        (rollout_commit_export if ok else rollout_cancel_export)(ctx, rec)
