"""`tidal up` / `tidal down` with the real servers on free ports, a tmp state dir, loopback-only sockets."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tidal.cli import services
from tidal.cli.services import (
    SERVICES,
    TELEMETRY_ENV,
    PidRecord,
    UpOptions,
    build_specs,
    group_members,
    listening_sockets,
    read_record,
    stop,
    trusted,
)
from tidal.core.errors import TidalError

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_gone(pid: int) -> bool:
    """Gone or a zombie (an orphaned zombie waits for an init that may not reap it; it holds nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rfind(")") + 2] in "ZX"


def tidal(*args: str, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli.main", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TIDAL_HOME": str(cwd / "home")})


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status


def check_up_then_down(tmp_path: Path, only: tuple[str, ...]) -> None:
    ports = {n: free_port() for n in SERVICES}
    flags = [f"--{n}-port={p}" for n, p in ports.items()] + ["--only", ",".join(only)]
    state = tmp_path / "home" / "services"  # $TIDAL_HOME/services
    out = tidal("up", *flags, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    recs = {n: read_record(state, n) for n in only}
    try:
        health = {"prefect": "/api/health", "mlflow": "/health", "optuna": "/api/meta"}
        for name, rec in recs.items():
            assert rec is not None and rec.port == ports[name] and rec.host == "127.0.0.1"
            assert f"http://127.0.0.1:{ports[name]}/" in out.stdout
            assert get(f"http://127.0.0.1:{ports[name]}{health[name]}") == 200
            assert get(f"http://127.0.0.1:{ports[name]}/") == 200  # the UI page
            members = group_members(rec.pid)
            socks = listening_sockets(members)
            assert (ports[name] in {p for _, _, p in socks}), socks
            assert {a for _, a, _ in socks} == {"127.0.0.1"}, f"{name} listens beyond loopback: {socks}"
            env = Path(f"/proc/{rec.pid}/environ").read_bytes().split(b"\0")
            for k, v in TELEMETRY_ENV.items():
                assert f"{k}={v}".encode() in env
        # Idempotent: a second `up` starts nothing new.
        again = tidal("up", *flags, cwd=tmp_path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "already running" in again.stdout and "starting" not in again.stdout
        assert {n: read_record(state, n).pid for n in only} == {n: r.pid for n, r in recs.items()}
        if "mlflow" in only:  # the UI serves the store the sink writes by default (cwd's mlruns.db)
            assert (tmp_path / "mlruns.db").is_file()
        if "optuna" in only:  # the dashboard reads where `tidal sweep` writes: the platform database
            assert (tmp_path / "tidal.db").is_file()
    finally:
        all_pids = {n: group_members(r.pid) for n, r in recs.items() if r is not None}
        down = tidal("down", cwd=tmp_path, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    for name, pids in all_pids.items():
        deadline = time.monotonic() + 10
        while not all(proc_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(proc_gone(p) for p in pids), (name, pids)
        assert not (state / f"{name}.pid").exists()
    again = tidal("down", cwd=tmp_path, timeout=60)
    assert again.returncode == 0 and "nothing running" in again.stdout


def test_up_down_optuna_only(tmp_path):
    check_up_then_down(tmp_path, ("optuna",))


@pytest.mark.slow
def test_up_down_all_services(tmp_path):
    check_up_then_down(tmp_path, SERVICES)


def test_build_specs_bind_and_telemetry(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("TIDAL_OPTUNA_STORAGE", "TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    opts = UpOptions(tmp_path / "state", prefect_port=1, mlflow_port=2, optuna_port=3)
    specs = {s.name: s for s in build_specs(opts)}
    assert list(specs) == list(SERVICES)
    for s in specs.values():
        assert s.host == "127.0.0.1" and "127.0.0.1" in s.argv and "0.0.0.0" not in s.argv
        assert dict(s.env).items() >= TELEMETRY_ENV.items()
    assert dict(specs["mlflow"].env)["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert specs["mlflow"].argv[specs["mlflow"].argv.index("--workers") + 1] == "1"
    # Relative SQLite stores are pinned to the directory `tidal up` ran in.
    assert f"sqlite:///{tmp_path.resolve()}/mlruns.db" in specs["mlflow"].argv
    assert specs["optuna"].argv[1] == f"sqlite:///{tmp_path.resolve()}/tidal.db"
    assert dict(specs["prefect"].env)["PREFECT_HOME"] == str(tmp_path / "state" / "prefect")
    assert dict(specs["prefect"].env)["PREFECT_UI_API_URL"] == "http://127.0.0.1:1/api"   # the UI finds its API
    assert [s.name for s in build_specs(UpOptions(tmp_path, only=("mlflow",)))] == ["mlflow"]


def test_the_dashboard_and_the_sweep_share_one_storage(tmp_path, monkeypatch):
    from tidal.core.config import TidalConfig
    from tidal.sweep import storage_url
    for var in ("TIDAL_OPTUNA_STORAGE", "TIDAL_DB_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    assert services.default_stores() == ("sqlite:///mlruns.db", "sqlite:///tidal.db")
    assert storage_url(TidalConfig(), None) == services.default_stores()[1]
    monkeypatch.setenv("TIDAL_DB_URL", "postgresql://tidal@127.0.0.1/tidal")
    assert services.default_stores()[1] == "postgresql://tidal@127.0.0.1/tidal"
    monkeypatch.setenv("TIDAL_OPTUNA_STORAGE", "sqlite:///studies.db")
    assert services.default_stores()[1] == storage_url(TidalConfig(), None) == "sqlite:///studies.db"


def _record(name: str, port: int) -> PidRecord:
    return PidRecord(name, 1, "127.0.0.1", port, f"http://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/h", name,
                     f"{name}.log", 0.0)


def test_the_env_file_points_runs_and_sweeps_at_the_services_up_started(tmp_path, monkeypatch):
    """Sourcing `<state>/env`: flows use the Prefect server (and start within seconds of a submit), runs log to the
    MLflow server, sweeps write the storage the dashboard shows, and the platform database is that storage."""
    monkeypatch.chdir(tmp_path)
    recs = [_record("prefect", 4201), _record("mlflow", 5001), _record("optuna", 8081)]
    opts = UpOptions(tmp_path / "state", optuna_storage="sqlite:///tidal.db")
    db = f"sqlite:///{tmp_path.resolve()}/tidal.db"
    assert services.env_lines(recs, opts, "sqlite:///tidal.db") == [
        "export PREFECT_API_URL=http://127.0.0.1:4201/api", "export PREFECT_RUNNER_POLL_FREQUENCY=1",
        "export PREFECT_LOGGING_TO_API_BATCH_INTERVAL=0.5",
        "export MLFLOW_TRACKING_URI=http://127.0.0.1:5001", f"export TIDAL_OPTUNA_STORAGE={db}",
        "export TIDAL_OPTUNA_DASHBOARD_URL=http://127.0.0.1:8081", f"export TIDAL_DB_URL={db}"]
    # a dashboard on its own storage: the platform database is left as it is
    other = UpOptions(tmp_path / "state", optuna_storage="postgresql://u:p@db/studies?x=1&y=2")
    assert services.env_lines(recs[2:], other, "sqlite:///tidal.db") == [
        "export TIDAL_OPTUNA_STORAGE='postgresql://u:p@db/studies?x=1&y=2'",
        "export TIDAL_OPTUNA_DASHBOARD_URL=http://127.0.0.1:8081"]
    assert services.env_lines(recs[1:2], opts, "sqlite:///tidal.db") == [
        "export MLFLOW_TRACKING_URI=http://127.0.0.1:5001"]
    # sourced by a shell: the variables as a run reads them
    monkeypatch.delenv("TIDAL_DB_URL", raising=False)
    path = services.write_env(tmp_path, opts, recs)
    assert path.stat().st_mode & 0o077 == 0   # a store URL may hold a password
    out = subprocess.run(["bash", "-c", f"source {path} && echo $MLFLOW_TRACKING_URI $TIDAL_DB_URL"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["http://127.0.0.1:5001", db]


def test_a_running_service_asked_for_other_settings_is_refused(tmp_path):
    """`tidal up` with another store than the running dashboard's: an error naming the service and the way out,
    nothing restarted; the same settings again: reused."""
    port = free_port()
    state = tmp_path / "state"
    first = UpOptions(state, optuna_port=port, only=("optuna",), optuna_storage=f"sqlite:///{tmp_path}/a.db")
    ok, failed = services.up(first, log=lambda _: None)
    try:
        assert not failed and ok[0].settings
        with pytest.raises(TidalError, match=r"tidal down --only optuna"):
            services.up(UpOptions(state, optuna_port=port, only=("optuna",),
                                  optuna_storage=f"sqlite:///{tmp_path}/b.db"), log=lambda _: None)
        again, _ = services.up(first, log=lambda _: None)
        assert again[0].pid == ok[0].pid
    finally:
        services.down(state, grace_s=5.0, log=lambda _: None)


def test_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(TidalError, match="--optuna-port"):
            services.up(UpOptions(tmp_path, optuna_port=port, only=("optuna",), optuna_storage="sqlite:///o.db"),
                        log=lambda _: None)
    assert read_record(tmp_path, "optuna") is None


def test_listening_sockets_sees_our_own(tmp_path):
    with socket.socket() as s4, socket.socket(socket.AF_INET6) as s6:
        s4.bind(("127.0.0.1", 0))
        s4.listen()
        s6.bind(("::1", 0))
        s6.listen()
        socks = listening_sockets([os.getpid()])
        assert (os.getpid(), "127.0.0.1", s4.getsockname()[1]) in socks
        assert (os.getpid(), "::1", s6.getsockname()[1]) in socks


def test_stop_kills_a_group_that_ignores_sigterm(tmp_path):
    # A leader plus a child, both ignoring SIGTERM: only SIGKILL after the grace period ends them.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); print('ready', flush=True); "
            "time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    time.sleep(0.3)  # the child has set its handler
    members = group_members(proc.pid)
    assert len(members) == 2
    rec = PidRecord("x", proc.pid, "127.0.0.1", 1, "", "", sys.executable, "", time.time())
    assert trusted(rec)
    assert stop(rec, grace_s=0.5) == "killed after grace period"
    assert all(proc_gone(p) for p in members)
    assert not trusted(rec)
    proc.wait(timeout=5)


def test_stale_and_recycled_pid_files_are_not_trusted(tmp_path):
    (tmp_path / "optuna.pid").write_text("not json")
    assert read_record(tmp_path, "optuna") is None
    # A live group leader that is not the recorded executable (a recycled pid): never signalled.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        rec = PidRecord("optuna", other.pid, "127.0.0.1", 1, "", "", "/nonexistent/optuna-dashboard", "", 0.0)
        assert group_members(other.pid) == [other.pid] and not trusted(rec)
        (tmp_path / "optuna.pid").write_text(json.dumps(rec.__dict__))
        assert services.down(tmp_path, log=lambda _: None) == {"optuna": "not running (stale pid file)"}
        assert not (tmp_path / "optuna.pid").exists()
        assert other.poll() is None
    finally:
        other.kill()
        other.wait(timeout=5)


def test_no_pickle_in_platform_modules():
    for rel in ("tidal/cli/services.py", "tidal/tracking.py"):
        tree = ast.parse((REPO / rel).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & {"pickle", "cloudpickle", "dill", "marshal"}, (rel, names)
