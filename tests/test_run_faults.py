"""An actor device's worker killed in the middle of a real `tidal train` run. The first time the run carries on in the
same process with its surviving workers from its newest checkpoint (`run.max_restarts`; tidal/pipeline/survivors.py);
the second time, restarts spent, it ends on record (exit 1, database `failed`, one line naming the device and how to
resume). Resumed from its last checkpoint it ends with the same weights, bit for bit, as a run that was never
interrupted: the steps run again were exact too. (Recovery from `actor.redundancy: host`'s copy, in process and
through the Prefect flow: tests/test_survivors.py, tests/test_flow_platform.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from training_equality import PARITY_REWARD, assert_same_training, checkpoint_sha, trained_from_folder

REPO = Path(__file__).resolve().parents[1]
TIDAL = str(Path(sys.executable).parent / "tidal")
STEPS = 3
COMMON = ["data.eval_size=8", "run.eval_every=1000", "run.checkpoint_every=1", f"run.num_steps={STEPS}",
          f"reward.function={PARITY_REWARD}",   # about half of every group rewarded: every iter trains
          # the actor on two devices (each is killed once), rollout and inference on one each
          "cluster.num_devices_per_node=4", "cluster.component_placement={actor: 0-1, rollout: 2, inference: 3}"]
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1",
       # the reward function's module, tests/parity_reward.py, is imported by the workers (and by validate's check)
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def _config(tmp_path: Path, hf_run_inputs) -> list[str]:
    """experiments/addition_dynamic.yaml's dynamic scheduling and GRPO settings on a Qwen2 checkpoint written by
    transformers, trained from GSM8K-format files, on 4 devices (COMMON): `tidal train`'s leading arguments."""
    cfg = yaml.safe_load((REPO / "experiments/addition_dynamic.yaml").read_text())
    del cfg["model"], cfg["warm_start"], cfg["data"]["task"]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return [str(tmp_path / "run.yaml"), *COMMON, *hf_run_inputs("qwen2")]


def _train(config: list[str], *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TIDAL, "train", *config, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _device_worker(pid: int, device: int) -> psutil.Process | None:
    """The worker process of `device` among `pid`'s descendants (its environment names it)."""
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.environ().get("TIDAL_DEVICE_ID") == str(device):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


def _kill_after(proc: subprocess.Popen, log: Path, line: str, device: int) -> None:
    """SIGKILL `device`'s worker once `line` is in the run's log."""
    deadline = time.monotonic() + 300
    while line not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = _device_worker(proc.pid, device)
    assert proc.poll() is None and victim, log.read_text()[-3000:]
    victim.send_signal(signal.SIGKILL)


def _killed_run(config: list[str], log: Path, args: list[str], kill_after: list[tuple[str, int]],
                timeout: float) -> int:
    """`tidal train` with a device's worker SIGKILLed once each (line, device) of `kill_after` has its line in the
    log (in turn); its exit code."""
    with open(log, "w") as out:
        proc = subprocess.Popen([TIDAL, "train", *config, *args], cwd=REPO, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for line, device in kill_after:
            _kill_after(proc, log, line, device)
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_actor_worker_restarts_the_run_then_fails_it_on_record_and_resume_is_bit_exact(tmp_path,
                                                                                                hf_run_inputs):
    config = _config(tmp_path, hf_run_inputs)
    clean = _train(config, f"run.output_dir={tmp_path}/clean", "--no-track")
    assert clean.returncode == 0, clean.stderr[-3000:]
    assert "zero advantage" not in clean.stdout + clean.stderr
    n_minibatches = yaml.safe_load((REPO / "experiments/addition_dynamic.yaml").read_text())["algorithm"][
        "n_minibatches"]
    (clean_dir,) = (tmp_path / "clean").glob("addition-dynamic-*")
    ref = trained_from_folder(clean_dir, n_minibatches, checkpoint_sha(tmp_path / "ckpt-qwen2"))

    log = tmp_path / "killed.log"
    track = [f"tracking.db_url=sqlite:///{tmp_path}/tidal.db", f"tracking.mlflow_uri=sqlite:///{tmp_path}/ml.db",
             f"tracking.mlflow_artifacts={tmp_path}/artifacts"]
    # the actor's devices, 0 and 1 (a lost rollout or inference device is recovered within the step:
    # tests/test_faults.py); the first kill carries on with device 1 from the checkpoint of step 1, the second,
    # restarts spent, ends the run on record
    shm = tmp_path / "shm"
    shm.mkdir()
    rc = _killed_run(config, log, [f"run.output_dir={tmp_path}/killed", "run.max_restarts=1", *track,
                                   "actor.redundancy=host", f"actor.redundancy_dir={shm}"],
                     [(f"step   1/{STEPS}", 0), (f"step   2/{STEPS}", 1)], timeout=180)
    said = log.read_text()
    assert rc == 1, said[-3000:]
    assert said.count("continuing on the survivors") == 1 and "died" in said and "--resume" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert not list(shm.iterdir())   # the host copy's memory is given back when the run ends, failed or not
    from sqlalchemy import create_engine, text
    with create_engine(f"sqlite:///{tmp_path}/tidal.db").connect() as conn:
        assert conn.execute(text("SELECT status FROM runs")).scalar_one() == "failed"
        faults = conn.execute(text("SELECT kind, device_id FROM fault_events ORDER BY id")).all()
        assert [tuple(f) for f in faults] == [("failed", 0), ("recovered", 0)], faults   # the restart
        steps = [r[0] for r in conn.execute(text("SELECT step FROM steps ORDER BY step"))]
        assert steps == [0, 1], steps   # each step recorded once, the restarted one included
        moves = [tuple(m) for m in conn.execute(text("SELECT device_id, to_owner, time FROM device_transitions"))]
        assert len(moves) == len(set(moves)) and (0, "failed") in {m[:2] for m in moves}, moves   # once each

    (ckpt,) = (tmp_path / "killed").glob("addition-dynamic-*/checkpoints")
    resumed = _train(config, f"run.output_dir={tmp_path}/resumed", "--no-track", "--resume", str(ckpt))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resumed_dir,) = (tmp_path / "resumed").glob("addition-dynamic-*")
    # its start is the checkpoint's (the CLI run's, unreadable here): its iters are held to train, its end to ref's
    assert_same_training(ref, trained_from_folder(resumed_dir, n_minibatches, None))
