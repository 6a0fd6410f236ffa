"""Platform database: migrations, schema == models, repository round trips, checks, concurrent writers.

Every test runs on SQLite (a temp file) and on PostgreSQL when TIDAL_TEST_PG_URL is set (`.ci/postgres.sh`
starts one and prints the export line); each PostgreSQL test gets its own throwaway schema.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import threading
import uuid
from dataclasses import dataclass

import pytest
from sqlalchemy import create_engine, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from db import (
    DeviceTransition,
    InvalidRecord,
    add_run,
    add_step,
    attach_mlflow_run,
    current_revision,
    downgrade,
    finish_run,
    forget_steps_from,
    head_revision,
    list_faults,
    list_migrations,
    list_reshards,
    list_runs,
    list_scheduler_events,
    list_steps,
    list_transitions,
    make_engine,
    open_database,
    record_fault,
    record_migration,
    record_reshard,
    record_scheduler_event,
    record_transition,
    record_transitions,
    schema_diff,
    session_scope,
    upgrade,
)
from db.migrate import VERSION_TABLE
from db.models import Base
from tidal.core.devices import DeviceLedger, Owner
from tidal.core.errors import ConfigError

PG_URL = os.environ.get("TIDAL_TEST_PG_URL")
BACKENDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgresql", id="postgresql", marks=pytest.mark.skipif(
        not PG_URL, reason="TIDAL_TEST_PG_URL is unset; run `eval \"$(.ci/postgres.sh)\"` to test PostgreSQL")),
]
NUM_WRITERS = 32
ROWS_PER_WRITER = 10


@pytest.fixture(params=BACKENDS)
def db_url(request, tmp_path):
    """A URL of an empty database: a fresh SQLite file, or a fresh PostgreSQL schema (first on search_path)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tidal.db'}"
        return
    schema = f"test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(make_url(PG_URL).set(drivername="postgresql+psycopg"))
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(False)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def engine(db_url):
    eng = open_database(db_url)
    yield eng
    eng.dispose()


def _new_run(engine, name="run") -> int:
    with session_scope(engine) as s:
        return add_run(s, name=name, config={"run": {"name": name}}).id


# --- migrations -------------------------------------------------------------------------------------------------


def test_migrations_apply_downgrade_and_reapply(db_url):
    eng = make_engine(db_url)
    try:
        assert current_revision(eng) is None
        upgrade(db_url)
        upgrade(db_url)  # at head already: a no-op
        assert current_revision(eng) == head_revision()
        assert set(inspect(eng).get_table_names()) == set(Base.metadata.tables) | {VERSION_TABLE}
        downgrade(db_url, "base")
        assert inspect(eng).get_table_names() == [VERSION_TABLE]
        upgrade(db_url)
        assert schema_diff(eng) == []
    finally:
        eng.dispose()


def test_migrated_schema_matches_the_models(engine):
    assert schema_diff(engine) == []


def test_concurrent_upgrades_migrate_once(db_url):
    errors: list[BaseException] = []

    def up():
        try:
            upgrade(db_url)
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=up) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    eng = make_engine(db_url)
    assert current_revision(eng) == head_revision() and schema_diff(eng) == []
    eng.dispose()


def test_the_flow_run_revision_migrates_both_ways_keeping_the_rows(db_url):
    """0004 adds `runs.prefect_flow_run_id` (indexed) to a database that holds runs, and takes it away again."""
    upgrade(db_url, "0003")
    eng = make_engine(db_url)
    try:
        with eng.begin() as conn:
            conn.execute(text("INSERT INTO runs (name, config, status, started_at, mlflow_run_id) "
                              "VALUES ('before', '{}', 'running', :t, 'm1')"), {"t": dt.datetime.now(dt.UTC)})
        upgrade(db_url)
        assert current_revision(eng) == head_revision() and schema_diff(eng) == []
        assert "ix_runs_prefect_flow_run_id" in {ix["name"] for ix in inspect(eng).get_indexes("runs")}
        with session_scope(eng) as s:
            (before,) = list_runs(s)
            assert (before.name, before.mlflow_run_id, before.prefect_flow_run_id) == ("before", "m1", None)
            before.prefect_flow_run_id = "f" * 36
        downgrade(db_url, "0003")
        assert "prefect_flow_run_id" not in {c["name"] for c in inspect(eng).get_columns("runs")}
        with eng.connect() as conn:
            assert conn.execute(text("SELECT name, mlflow_run_id FROM runs")).all() == [("before", "m1")]
        upgrade(db_url)
        assert schema_diff(eng) == []
    finally:
        eng.dispose()


# --- repository round trips -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:  # stands in for the actor layout value the reshard planner records
    tp: int
    dp: int
    devices: tuple[int, ...]


def test_round_trip_of_every_repository_function(engine):
    t0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    with session_scope(engine) as s:
        run = add_run(s, name="gsm8k-grpo", config={"run": {"seed": 3}, "cluster": {"actor": "0-1"}},
                      output_dir="runs/gsm8k", started_at=t0)
        other = add_run(s, name="other", config={})
    with session_scope(engine) as s:
        attach_mlflow_run(s, run.id, "a" * 32)
        add_step(s, run.id, step=1, step_seconds=2.5, phase_seconds={"train": 1.5, "generate": 1.0})
        add_step(s, run.id, step=0, step_seconds=4.0, phase_seconds={"generate": 3.0, "train": 1}, reward=0.25,
                 eval_accuracy=0.5, device_idle_fraction=0.125)
        ledger = DeviceLedger(range(4), clock=iter(range(1, 100)).__next__)
        ledger.assign([0, 1], Owner.ACTOR, "placement")
        ledger.release([1], "actor shrinks")
        ledger.land([1], Owner.ROLLOUT, "rollout grows")
        ledger.assign([2, 3], Owner.SHARED, "placement")   # a collocated placement's devices
        record_transitions(s, run.id, ledger.history)
        record_transition(s, run.id, device_id=0, from_owner="actor", to_owner="free", reason="shutdown", time=9.0)
        record_reshard(s, run.id, step=0, iter=2, from_layout=Layout(2, 1, (0, 1)),
                       to_layout={"tp": 1, "dp": 1, "devices": [0]}, devices=[0, 1], bytes_moved=3 * 2**33,
                       seconds=0.75, ok=True, reason="rollout needs device 1")
        record_reshard(s, run.id, step=1, iter=0, from_layout={"tp": 1, "dp": 1, "devices": [0]},
                       to_layout={"tp": 1, "dp": 2, "devices": [0, 1]}, devices=[1, 0], bytes_moved=0, seconds=0.0,
                       ok=False, reason="rank 1 timed out; rolled back")
        record_migration(s, run.id, step=0, request_id="r-17", group_id=4, source_instance="rollout-0",
                         target_instance="rollout-1", mode="kv", tokens=300, bytes=2**31, seconds=0.01, ok=True,
                         reason="rollout-0 drains")
        record_scheduler_event(s, run.id, step=0, iter=1, time=5.5, policy="tidal", kind="decision",
                               action_type="move_devices", devices=[1], reason="rollout queue > 2x actor")
        record_scheduler_event(s, run.id, step=0, time=5.75, policy="tidal", kind="action",
                               action_type="move_devices", devices=[1], reason="applying decision",
                               outcome="applied")
        record_scheduler_event(s, other.id, step=0, time=0.0, policy="static", kind="decision", devices=[],
                               reason="nothing to do")
    with session_scope(engine) as s:
        finish_run(s, run.id, status="finished", ended_at=t0 + dt.timedelta(hours=1))

    with session_scope(engine) as s:
        runs = list_runs(s)
        assert [(r.name, r.status) for r in runs] == [("gsm8k-grpo", "finished"), ("other", "running")]
        got = runs[0]
        assert got.config == {"run": {"seed": 3}, "cluster": {"actor": "0-1"}}
        assert (got.started_at, got.ended_at) == (t0, t0 + dt.timedelta(hours=1))
        assert (got.mlflow_run_id, got.output_dir) == ("a" * 32, "runs/gsm8k")
        assert [r.name for r in list_runs(s, status="running")] == ["other"]

        steps = list_steps(s, run.id)
        assert [(x.step, x.reward, x.eval_accuracy, x.step_seconds, x.phase_seconds, x.device_idle_fraction)
                for x in steps] == [(0, 0.25, 0.5, 4.0, {"generate": 3.0, "train": 1.0}, 0.125),
                                    (1, None, None, 2.5, {"train": 1.5, "generate": 1.0}, None)]

        moves = [(t.device_id, t.from_owner, t.to_owner, t.reason, t.time) for t in list_transitions(s, run.id)]
        assert moves == [(t.device, t.src.value, t.dst.value, t.reason, t.time) for t in ledger.history] + [
            (0, "actor", "free", "shutdown", 9.0)]
        assert [m[:4] for m in moves[:4]] == [(0, "free", "actor", "placement"), (1, "free", "actor", "placement"),
                                              (1, "actor", "moving", "actor shrinks"),
                                              (1, "moving", "rollout", "rollout grows")]
        assert [t.to_owner for t in list_transitions(s, run.id, device_id=1)] == ["actor", "moving", "rollout"]

        r0, r1 = list_reshards(s, run.id)
        assert (r0.step, r0.iter, r0.from_layout, r0.to_layout, r0.devices, r0.bytes_moved, r0.seconds, r0.ok) == (
            0, 2, {"tp": 2, "dp": 1, "devices": [0, 1]}, {"tp": 1, "dp": 1, "devices": [0]}, [0, 1], 3 * 2**33,
            0.75, True)
        assert (r1.devices, r1.ok, r1.reason) == ([1, 0], False, "rank 1 timed out; rolled back")

        (m,) = list_migrations(s, run.id)
        assert (m.step, m.request_id, m.group_id, m.source_instance, m.target_instance, m.mode, m.tokens, m.bytes,
                m.seconds, m.ok, m.reason) == (0, "r-17", "4", "rollout-0", "rollout-1", "kv", 300, 2**31, 0.01,
                                               True, "rollout-0 drains")

        events = list_scheduler_events(s, run.id)
        assert [(e.kind, e.iter, e.time, e.policy, e.action_type, e.devices, e.outcome) for e in events] == [
            ("decision", 1, 5.5, "tidal", "move_devices", [1], None),
            ("action", None, 5.75, "tidal", "move_devices", [1], "applied")]
        assert [e.kind for e in list_scheduler_events(s, run.id, kind="action")] == ["action"]
        assert [e.policy for e in list_scheduler_events(s, other.id)] == ["static"]


def test_a_lost_device_its_recovery_and_its_rejoin_are_rows_with_seconds_and_bytes(engine):
    """A rollout device fails, its work is done again, it rejoins: the ledger's moves through FAILED meet the
    migrated owner constraint, and each fault is a row of fault_events (an unknown kind is refused)."""
    run_id = _new_run(engine)
    ledger = DeviceLedger(range(2), clock=iter(range(1, 100)).__next__)
    ledger.assign([0, 1], Owner.ROLLOUT, "placement")
    ledger.fail(1, "worker process 77 exited")
    ledger.rejoin(1, "replacement worker (pid 78) answers")
    with session_scope(engine) as s:
        record_transitions(s, run_id, ledger.history)
        record_fault(s, run_id, step=3, time=5.0, kind="failed", device_id=1, role="rollout",
                     reason="worker process 77 exited", seconds=0.02, bytes=1800, groups=2)
        record_fault(s, run_id, step=3, time=7.5, kind="recovered", device_id=1, role="rollout",
                     reason="its 2 groups done again on the survivors", seconds=2.5, groups=2, tokens=96)
        record_fault(s, run_id, step=4, time=12.0, kind="rejoined", device_id=1, role="rollout",
                     reason="replacement worker (pid 78) answers", seconds=7.0, bytes=5000)
    with session_scope(engine) as s:
        assert [(t.from_owner, t.to_owner) for t in list_transitions(s, run_id, device_id=1)] == [
            ("free", "rollout"), ("rollout", "failed"), ("failed", "free")]
        assert [(f.kind, f.step, f.seconds, f.bytes, f.groups, f.tokens) for f in list_faults(s, run_id)] == [
            ("failed", 3, 0.02, 1800, 2, 0), ("recovered", 3, 2.5, 0, 2, 96), ("rejoined", 4, 7.0, 5000, 0, 0)]
    with pytest.raises(InvalidRecord, match="fault.kind"), session_scope(engine) as s:
        record_fault(s, run_id, step=0, time=0.0, kind="crashed", device_id=1, role="rollout", reason="r",
                     seconds=0.0)


def test_a_restart_forgets_the_steps_it_runs_again(engine):
    run_id = _new_run(engine)
    with session_scope(engine) as s:
        for step in range(4):
            add_step(s, run_id, step=step, step_seconds=1.0, phase_seconds={"actor": 0.5})
    with session_scope(engine) as s:
        assert forget_steps_from(s, run_id, 2) == 2
        add_step(s, run_id, step=2, step_seconds=2.0, phase_seconds={"actor": 0.5})   # recorded again, once
    with session_scope(engine) as s:
        assert [(r.step, r.step_seconds) for r in list_steps(s, run_id)] == [(0, 1.0), (1, 1.0), (2, 2.0)]


def test_a_run_row_holds_its_flow_run_and_mlflow_run_ids(engine):
    flow_run_id = str(uuid.uuid4())
    with session_scope(engine) as s:
        run = add_run(s, name="served", config={}, prefect_flow_run_id=flow_run_id)
        add_run(s, name="by-cli", config={})
    with session_scope(engine) as s:
        attach_mlflow_run(s, run.id, "b" * 32)
    with session_scope(engine) as s:
        (got,) = list_runs(s, prefect_flow_run_id=flow_run_id)
        assert (got.id, got.name, got.prefect_flow_run_id, got.mlflow_run_id) == (run.id, "served", flow_run_id,
                                                                                  "b" * 32)
        assert list_runs(s, prefect_flow_run_id=str(uuid.uuid4())) == []
        assert [r.prefect_flow_run_id for r in list_runs(s)] == [flow_run_id, None]
        with pytest.raises(InvalidRecord, match="run.prefect_flow_run_id"):
            add_run(s, name="x", config={}, prefect_flow_run_id="x" * 65)


def test_session_scope_rolls_back_the_whole_unit_on_error(engine):
    run_id = _new_run(engine)
    with pytest.raises(InvalidRecord), session_scope(engine) as s:
        add_step(s, run_id, step=0, step_seconds=1.0, phase_seconds={})
        add_step(s, run_id, step=1, step_seconds=-1.0, phase_seconds={})  # bad: the unit is rolled back
    with session_scope(engine) as s:
        assert list_steps(s, run_id) == []


# --- checks -----------------------------------------------------------------------------------------------------

EVENT = dict(step=0, iter=0, from_layout={"tp": 1}, to_layout={"tp": 2}, devices=[0, 1], bytes_moved=1, seconds=0.1,
             ok=True, reason="r")
MIGRATION = dict(step=0, request_id="r", group_id="g", source_instance="a", target_instance="b", mode="kv", tokens=1,
                 bytes=1, seconds=0.1, ok=True, reason="r")
SCHED = dict(step=0, time=0.0, policy="tidal", kind="decision", devices=[0], reason="r")
TRANSITION = dict(device_id=0, from_owner="free", to_owner="actor", reason="r", time=0.0)
STEP = dict(step=0, step_seconds=1.0, phase_seconds={"train": 1.0})

BAD_INPUTS = [  # (function, keyword args, field the error must name)
    (record_transition, {**TRANSITION, "to_owner": "trainer"}, "transition.to_owner"),
    (record_transition, {**TRANSITION, "device_id": -1}, "transition.device_id"),
    (record_transition, {**TRANSITION, "reason": " "}, "transition.reason"),
    (record_reshard, {**EVENT, "bytes_moved": -5}, "reshard.bytes_moved"),
    (record_reshard, {**EVENT, "devices": [0, 0]}, "reshard.devices"),
    (record_reshard, {**EVENT, "from_layout": {"tp": float("nan")}}, "reshard.from_layout"),
    (record_reshard, {**EVENT, "ok": 1}, "reshard.ok"),
    (record_migration, {**MIGRATION, "mode": "rdma"}, "migration.mode"),
    (record_migration, {**MIGRATION, "target_instance": "a"}, "migration.target_instance"),
    (record_migration, {**MIGRATION, "request_id": "x" * 65}, "migration.request_id"),
    (record_scheduler_event, {**SCHED, "kind": "plan"}, "scheduler_event.kind"),
    (record_scheduler_event, {**SCHED, "kind": "action"}, "scheduler_event.action_type"),
    (record_scheduler_event, {**SCHED, "time": float("inf")}, "scheduler_event.time"),
    (add_step, {**STEP, "eval_accuracy": 1.5}, "step.eval_accuracy"),
    (add_step, {**STEP, "phase_seconds": {"train": -1.0}}, "step.phase_seconds['train']"),
    (add_step, {**STEP, "step": True}, "step.step"),
]


def test_bad_inputs_are_refused_naming_the_field(engine):
    run_id = _new_run(engine)
    for fn, kwargs, field in BAD_INPUTS:
        with session_scope(engine) as s:
            with pytest.raises(InvalidRecord) as info:
                fn(s, run_id, **kwargs)
            assert info.value.field == field, (fn.__name__, kwargs)
            assert field in str(info.value) and "Fix:" in str(info.value)
    with session_scope(engine) as s:  # nothing half-written by the refused calls
        assert (list_steps(s, run_id), list_transitions(s, run_id), list_reshards(s, run_id),
                list_migrations(s, run_id), list_scheduler_events(s, run_id)) == ([], [], [], [], [])


def test_run_lifecycle_errors(engine):
    run_id = _new_run(engine)
    with session_scope(engine) as s:
        with pytest.raises(InvalidRecord, match="run_id: names no run"):
            add_step(s, run_id + 100, **STEP)
        add_step(s, run_id, **STEP)
        with pytest.raises(InvalidRecord, match="step 0 of run .* is already recorded"):
            add_step(s, run_id, **STEP)
        with pytest.raises(InvalidRecord, match="run.status.*pass one of"):
            finish_run(s, run_id, status="running")
        with pytest.raises(InvalidRecord, match="run.started_at"):
            add_run(s, name="x", config={}, started_at=dt.datetime(2026, 1, 1))
        with pytest.raises(InvalidRecord, match="run.config"):
            add_run(s, name="x", config={"path": object()})
        finish_run(s, run_id, status="failed")
        with pytest.raises(InvalidRecord, match="already ended as 'failed'"):
            finish_run(s, run_id)


def test_database_constraints_back_the_checks(engine):
    """Rows that bypass the repository still meet the migrated CHECK and FOREIGN KEY constraints."""
    run_id = _new_run(engine)
    bad_rows = [DeviceTransition(run_id=run_id, device_id=0, from_owner="free", to_owner="trainer", reason="r",
                                 time=0.0),
                DeviceTransition(run_id=run_id + 100, device_id=0, from_owner="free", to_owner="actor", reason="r",
                                 time=0.0)]
    for row in bad_rows:
        with pytest.raises(IntegrityError), session_scope(engine) as s:
            s.add(row)


def test_deleting_a_run_deletes_its_rows(engine):
    """ON DELETE CASCADE holds on both backends (SQLite enforces foreign keys only when asked to)."""
    from sqlalchemy import delete, func

    from db.models import Run, SchedulerEvent, Step

    run_id, keep_id = _new_run(engine), _new_run(engine, "keep")
    with session_scope(engine) as s:
        for rid in (run_id, keep_id):
            add_step(s, rid, **STEP)
            record_scheduler_event(s, rid, **SCHED)
    with session_scope(engine) as s:
        s.execute(delete(Run).where(Run.id == run_id))
    with session_scope(engine) as s:
        for model in (Step, SchedulerEvent):
            assert s.scalar(select(func.count()).select_from(model)) == 1
            assert s.scalar(select(model.run_id)) == keep_id


def test_bad_urls_name_the_config_field(tmp_path):
    with pytest.raises(ConfigError, match="tracking.db_url.*mysql"):
        make_engine("mysql://u@127.0.0.1/x")
    with pytest.raises(ConfigError, match="tracking.db_url.*does not exist"):
        make_engine(f"sqlite:///{tmp_path}/missing/dir/tidal.db")
    assert make_engine("postgresql://u:p@127.0.0.1/x").url.drivername == "postgresql+psycopg"


# --- concurrent writers -----------------------------------------------------------------------------------------


def _writer(url: str, writer: int, barrier=None, shared_engine=None) -> None:
    """One writer: its own run (made after opening the database), then one transaction per event row."""
    if barrier is not None:
        barrier.wait()
    engine = shared_engine or open_database(url)
    with session_scope(engine) as s:
        run_id = add_run(s, name=f"writer-{writer}", config={"writer": writer}).id
    for i in range(ROWS_PER_WRITER):
        with session_scope(engine) as s:
            record_scheduler_event(s, run_id, step=writer, iter=i, time=float(i), policy="test", kind="decision",
                                   devices=[writer], reason=f"writer {writer} row {i}")
    if shared_engine is None:
        engine.dispose()


def _assert_nothing_lost(url: str) -> None:
    engine = make_engine(url)
    with session_scope(engine) as s:
        runs = list_runs(s)
        assert sorted(r.config["writer"] for r in runs) == list(range(NUM_WRITERS))
        for run in runs:
            iters = [e.iter for e in list_scheduler_events(s, run.id)]
            assert iters == list(range(ROWS_PER_WRITER)), run.name
        assert len(list(s.scalars(select(DeviceTransition)))) == 0
    engine.dispose()


def test_concurrent_thread_writers_lose_nothing(db_url):
    upgrade(db_url)
    shared = make_engine(db_url)
    errors: list[BaseException] = []
    barrier = threading.Barrier(NUM_WRITERS)

    def body(w: int) -> None:
        try:
            _writer(db_url, w, barrier, shared_engine=shared)
        except BaseException as exc:  # noqa: BLE001 - collected and reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(w,)) for w in range(NUM_WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.dispose()
    assert errors == []
    _assert_nothing_lost(db_url)


def test_concurrent_process_writers_lose_nothing_sqlite(tmp_path):
    """32 processes open a fresh SQLite file at once (each migrating it) and write; no row is lost."""
    url = f"sqlite:///{tmp_path / 'tidal.db'}"
    ctx = multiprocessing.get_context("fork")  # children inherit the imports: 32 spawns would cost seconds each
    barrier = ctx.Barrier(NUM_WRITERS)
    procs = [ctx.Process(target=_writer, args=(url, w, barrier)) for w in range(NUM_WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0] * NUM_WRITERS
    _assert_nothing_lost(url)


def test_retry_locked_retries_only_lock_errors_and_gives_up_at_the_deadline():
    import sqlite3

    from db.session import retry_locked

    attempts = []

    def locked_twice():
        attempts.append(1)
        if len(attempts) < 3:
            raise sqlite3.OperationalError("database is locked")
        return "done"

    assert retry_locked(locked_twice, deadline_s=5.0) == "done" and len(attempts) == 3

    def broken():
        attempts.append(1)
        raise sqlite3.OperationalError("no such table: runs")

    attempts.clear()
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        retry_locked(broken, deadline_s=5.0)
    assert len(attempts) == 1

    def always_locked():
        raise sqlite3.OperationalError("database is locked")

    with pytest.raises(sqlite3.OperationalError, match="locked"):
        retry_locked(always_locked, deadline_s=0.05)


def test_db_imports_no_engine_worker_or_orchestration_code():
    import ast
    from pathlib import Path

    import db

    forbidden = ("tidal.engine", "tidal.workers", "scheduler", "flows", "tasks", "torch",
                 "prefect", "mlflow", "ray", "optuna")
    root = Path(db.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n.split(".")[0] in forbidden or n.startswith(forbidden)]
            assert not bad, f"{path.relative_to(root)} imports {bad}"
