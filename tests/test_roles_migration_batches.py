"""The per-device batches of a migration wave (workers/roles.py): one call per device and phase does what one
call per move did, in the same order, and a failed import is reported per move, not raised."""

import pytest

from tidal.engine.generation.requests import Request, RequestState
from tidal.workers import roles


class Ctx:
    state: dict = {}


@pytest.fixture
def calls(monkeypatch):
    log = []
    monkeypatch.setattr(roles, "rollout_export", lambda ctx, count=None: log.append(("export", count)) or
                        {"count": count})

    def imp(ctx, package):
        log.append(("import", package["count"]))
        if package["count"] == 2:
            raise ValueError("policy version 9 != 3")
        return package["count"]
    monkeypatch.setattr(roles, "rollout_import", imp)
    monkeypatch.setattr(roles, "rollout_commit_export", lambda ctx, r: log.append(("commit", r)))
    monkeypatch.setattr(roles, "rollout_cancel_export", lambda ctx, r: log.append(("cancel", r)))
    return log


def test_batches_keep_the_order_and_report_failed_imports_per_move(calls):
    ctx = Ctx()
    pkgs = roles.rollout_export_many(ctx, [1, None, 2])
    assert calls == [("export", 1), ("export", None), ("export", 2)]
    got = roles.rollout_import_many(ctx, [pkgs[0], pkgs[2], {"count": 3}])
    assert got == [{"ok": True, "requests": 1}, {"ok": False, "error": "ValueError: policy version 9 != 3"},
                   {"ok": True, "requests": 3}]   # the failure did not stop the next import
    calls.clear()
    roles.rollout_settle_exports(ctx, ["a", "b", "c"], [True, False, True])
    assert calls == [("commit", "a"), ("cancel", "b"), ("commit", "c")]
    with pytest.raises(ValueError):
        roles.rollout_settle_exports(ctx, ["a"], [True, False])   # one flag per receipt


def test_a_receipt_carries_ids_not_kv_caches():
    import torch
    st = RequestState(Request("m/g4/i0", (1, 2)), [5, 6], [0.0, 0.0], torch.zeros(8, dtype=torch.uint8), 0)
    rec = roles.export_receipt({"states": [st], "open": {4: ((1, 2), [])}, "queued": ["q"]})
    assert rec == {"request_ids": ["m/g4/i0"], "open": [4], "queued": ["q"]}
