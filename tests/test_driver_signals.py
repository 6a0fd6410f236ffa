"""SIGINT and SIGTERM to a training driver: each shuts the run down the same way (its MLflow run ends KILLED and its
database row `aborted`) and exits 130 or 143.

SIGTERM goes to a real `tidal train` process: the CLI's handler (which raises `Terminated`, a KeyboardInterrupt)
must survive `ray.init`, which installs its own, and the run's shutdown must record it. SIGINT raises Python's own
KeyboardInterrupt, which takes the same path from there (every shutdown path in the run and its tracking catches
KeyboardInterrupt, never `Terminated` alone); what is its own is the exit code, checked here with a real SIGINT to
a command `tidal.cli.main.main` runs."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIDAL = Path(sys.executable).parent / "tidal"
#: one device per component (the shutdown stops however many workers there are): a run with workers and a
#: dynamic scheduler, started in a third of the 8-device placement's time
PLACEMENT = ["cluster.num_devices_per_node=3", "cluster.component_placement={actor: 0, rollout: 1, inference: 2}"]


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "train.log"
    cmd = [str(TIDAL), "train", "experiments/addition_dynamic.yaml", f"run.output_dir={tmp_path}/runs",
           f"tracking.db_url=sqlite:///{tmp_path}/tidal.db", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db",
           f"tracking.mlflow_artifacts={tmp_path}/artifacts", "warm_start.iters=0", "run.num_steps=1000",
           "data.eval_size=8", "run.eval_every=1000", *PLACEMENT]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
    with open(log, "w") as out:   # the child holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log


def _records(tmp_path: Path) -> tuple[str, str]:
    import mlflow
    from sqlalchemy import create_engine, text
    with create_engine(f"sqlite:///{tmp_path}/tidal.db").connect() as conn:
        status = conn.execute(text("SELECT status FROM runs")).scalar_one()
    runs = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns.db").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlruns.db").search_experiments()])
    return status, runs[0].info.status


@pytest.mark.slow
def test_sigterm_shuts_the_run_down_and_records_it_aborted(tmp_path):
    proc, log = _start(tmp_path)
    try:
        deadline = time.monotonic() + 300
        while "step   2/1000" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        os.kill(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:   # every thread's stack into the log (the CLI's SIGUSR1), then fail
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(3)
            pytest.fail("no exit within 120 s of SIGTERM; the log's end:\n" + log.read_text()[-12000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 143, out[-3000:]
    assert "Traceback" not in out and "SIGABRT" not in out, out[-3000:]
    assert _records(tmp_path) == ("aborted", "KILLED")


def _wait_for_a_signal(argv: list[str]) -> int:
    """A command that sends its own process SIGINT and waits for it."""
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(300):   # short sleeps: the main thread runs the handler within one, whichever thread took it
        time.sleep(0.1)
    return 0


def test_sigint_to_a_command_exits_130(monkeypatch, capsys):
    """A real SIGINT while a command runs: Python's KeyboardInterrupt reaches the CLI, which says `interrupted` and
    exits 130 (128 + SIGINT), not SIGTERM's 143."""
    from tidal.cli import main as cli

    monkeypatch.setattr(cli, "_sigterm_seen", False)
    monkeypatch.setitem(cli.COMMANDS, "wait", (f"{__name__}:_wait_for_a_signal", "wait for a signal"))
    # Python's handler, as a process started from a shell has it (a background test run inherits SIGINT ignored)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        t0 = time.monotonic()
        assert cli.main(["wait"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t0 < 10
    assert capsys.readouterr().err.strip() == "interrupted"
