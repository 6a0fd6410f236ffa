"""The per-device batches of a migration wave (tidal/workers/roles_migration.py): one call per device and phase
does what one call per move did, in the same order; a target imports from the exports' results (small records),
and a failed import (or export) is reported per move, not raised."""

from typing import ClassVar

import pytest

from tidal.engine.generation.requests import Request, RequestState
from tidal.workers import roles_migration as roles
from tidal.workers.messages import ExportReceipt, MigrationPackage, MoveResult, MoveSummary, PackageRef


class Ctx:
    state: ClassVar[dict] = {}


class Slot:
    outbox = None


@pytest.fixture
def calls(monkeypatch):
    log = []
    monkeypatch.setattr(roles, "rollout_export", lambda ctx, count=None, route="p2p": log.append(("export", count))
                        or {"count": count})
    monkeypatch.setattr(roles, "rollout_slot", lambda ctx: Slot())

    monkeypatch.setattr(roles, "rollout_commit_export", lambda ctx, r: log.append(("commit", r)))
    monkeypatch.setattr(roles, "rollout_cancel_export", lambda ctx, r: log.append(("cancel", r)))
    return log


def test_batches_keep_the_order_of_exports_and_settles(calls):
    ctx = Ctx()
    assert roles.rollout_export_many(ctx, [1, None, 2]) == [{"count": 1}, {"count": None}, {"count": 2}]
    assert calls == [("export", 1), ("export", None), ("export", 2)]
    calls.clear()
    roles.rollout_settle_exports(ctx, ["a", "b", "c"], [True, False, True])
    assert calls == [("commit", "a"), ("cancel", "b"), ("commit", "c")]
    with pytest.raises(ValueError):
        roles.rollout_settle_exports(ctx, ["a"], [True, False])   # one flag per receipt


def test_a_receipt_carries_ids_not_kv_caches():
    import torch
    st = RequestState(Request("m/g4/i0", (1, 2)), [5, 6], [0.0, 0.0], torch.zeros(8, dtype=torch.uint8), 0)
    rec = MigrationPackage(("q",), {4: ((1, 2), [])}, (st,)).receipt()
    assert rec == ExportReceipt(("m/g4/i0",), (4,), ("q",))


def test_import_from_the_exports_results_reports_summaries_and_receipts(monkeypatch):
    """A target takes its packages straight from the sources' export results: per move the summary the driver
    books (and the receipt its source settles with); a failed import keeps its receipt (the source cancels), a
    failed export fails its moves with no receipt (nothing was exported)."""
    import ray
    import torch
    st = RequestState(Request("m/g4/i0", (1, 2)), [5, 6], [0.0, 0.0], torch.zeros(8, dtype=torch.uint8), 0)
    pkg = MigrationPackage(("q",), {4: ((1, 2), [])}, (st,))
    bad = MigrationPackage(("boom",), {}, ())
    store = {"ref_a": [bad, pkg], "ref_b": RuntimeError("source died")}

    def get(ref):
        if isinstance(store[ref], Exception):
            raise store[ref]
        return store[ref]
    monkeypatch.setattr(ray, "get", get)
    imported = []

    def imp(ctx, package, source=None, route="p2p"):
        if package.queued == ("boom",):
            raise ValueError("policy version 9 != 3")
        imported.append(package)
        return len(package.states)
    monkeypatch.setattr(roles, "rollout_import", imp)
    got = roles.rollout_import_from(Ctx(), [PackageRef("ref_a", 1, 0, "p2p"), PackageRef("ref_b", 0, 1, "p2p"),
                                            PackageRef("ref_a", 0, 0, "p2p")])
    assert imported == [pkg]
    assert all(r.fetch_s >= 0 and r.import_s >= 0 for r in got)   # the call's own timing, on every move
    untimed = [MoveResult(r.ok, r.summary, r.receipt, r.error, r.exported) for r in got]
    assert untimed[0] == MoveResult(True, MoveSummary(requests=1, tokens=2, open=1, queued=1, kv_bytes=0),
                                    ExportReceipt(("m/g4/i0",), (4,), ("q",)))
    assert untimed[1] == MoveResult(False, exported=False, error="export: RuntimeError: source died")
    assert untimed[2] == MoveResult(False, receipt=ExportReceipt((), (), ("boom",)),
                                    error="ValueError: policy version 9 != 3")
