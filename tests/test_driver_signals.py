"""SIGINT and SIGTERM to a training driver, as a real `tidal train` process: each shuts the run down the same way
(its MLflow run ends KILLED and its database row `aborted`) and exits 130 or 143."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIDAL = Path(sys.executable).parent / "tidal"


def _start(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "train.log"
    cmd = [str(TIDAL), "train", "experiments/addition_dynamic.yaml", f"run.output_dir={tmp_path}/runs",
           f"tracking.db_url=sqlite:///{tmp_path}/tidal.db", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db",
           f"tracking.mlflow_artifacts={tmp_path}/artifacts", "warm_start.iters=0", "run.num_steps=1000",
           "data.eval_size=8", "run.eval_every=1000"]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
    with open(log, "w") as out:   # the child holds its own copy of the descriptor
        # SIGINT back to its default first: a test run started in the background (`cmd &`) ignores SIGINT, the
        # child would inherit that, and Python installs its KeyboardInterrupt handler only over the default
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_shuts_the_run_down_and_records_it_aborted(tmp_path, sig, code):
    proc, log = _start(tmp_path)
    try:
        deadline = time.monotonic() + 300
        while "step   2/1000" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()[-3000:]
        os.kill(proc.pid, sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == code, out[-3000:]
    assert "Traceback" not in out and "SIGABRT" not in out, out[-3000:]
    assert _records(tmp_path) == ("aborted", "KILLED")
