"""What a flow run shows in the Prefect UI, as text: the step line, progress, artifact keys, the summary and the
MLflow address (`tasks.reporting`, pure: no Prefect, no MLflow)."""

from __future__ import annotations

import re

import pytest

from tasks.reporting import (
    artifact_key,
    mlflow_run_markdown,
    progress_percent,
    step_line,
    summary_markdown,
)

STEP = {"grpo/reward_mean": 0.41234, "eval/heldout_accuracy": 0.5625, "step/time_s": 3.844,
        "phase/rollout_device_s": 2.911, "phase/inference_device_s": 0.62, "phase/actor_device_s": 1.8,
        "phase/moving_device_s": 0.3,
        "sync/time_s": 0.214, "reshard/count": 2.0, "reshard/total_s": 0.091, "migration/count": 1.0,
        "migration/total_s": 0.02}


def test_step_line_holds_reward_heldout_time_phases_and_moves():
    assert step_line(1, 10, STEP) == (
        "step 1 of 10  reward 0.412  held-out 0.562  3.84 s | generate 2.91  score 0.62  train 1.80 device-s  "
        "sync 0.21 s | 2 reshards 0.09 s  1 migration 0.02 s")


def test_step_line_of_a_step_without_evaluation_or_moves():
    m = {k: v for k, v in STEP.items() if k != "eval/heldout_accuracy"}
    m.update({"reshard/count": 0.0, "reshard/total_s": 0.0, "migration/count": 0.0, "migration/total_s": 0.0})
    line = step_line(0, 2, m)
    assert "held-out" not in line
    assert line.endswith("| 0 reshards 0.00 s  0 migrations 0.00 s") and line.startswith("step 0 of 2  reward 0.412")


@pytest.mark.parametrize("name", ["addition-dynamic", "Addition_Dynamic", "run.v2", "-x-", "a  b", "ÜBER", "--"])
def test_artifact_keys_are_what_prefect_accepts(name):
    key = artifact_key(name, "summary")
    assert re.fullmatch(r"[a-z0-9-]+", key) and key.endswith("summary") and not key.startswith("-")


def test_artifact_keys_keep_the_run_name_readable():
    assert artifact_key("addition_dynamic", "progress") == "addition-dynamic-progress"
    assert artifact_key("Run.V2", "summary") == "run-v2-summary"


def test_progress_is_a_percent_of_steps_done():
    assert [progress_percent(k, 3) for k in (0, 1, 3, 4)] == [0.0, 33.33, 100.0, 100.0]
    assert progress_percent(0, 0) == 100.0


def test_mlflow_address_for_a_server_a_local_store_and_no_tracking():
    assert mlflow_run_markdown("http://127.0.0.1:5000/", "3", "abc") == (
        "MLflow run: [abc](http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning)")
    local = mlflow_run_markdown("sqlite:///mlruns.db", "1", "abc")
    assert "`abc`" in local and "mlflow ui --backend-store-uri sqlite:///mlruns.db --host 127.0.0.1" in local
    assert "(http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning)" in local
    assert mlflow_run_markdown(None, None, None).startswith("MLflow: not tracked")


def test_a_password_in_the_tracking_uri_never_reaches_the_markdown():
    text = mlflow_run_markdown("https://bob:s3cret@mlflow.example:5000", "1", "abc")
    assert "s3cret" not in text and "https://bob:***@mlflow.example:5000/#/experiments/1/runs/abc" in text


def test_summary_markdown_is_a_table_of_the_run_then_its_mlflow_run():
    summary = {"name": "addition-dynamic", "steps": 2, "wall_s": 61.23, "eval_accuracy_start": 0.5,
               "eval_accuracy_end": 0.5625, "reward_per_step": [0.25, 0.375], "step_seconds": [4.0, 3.0],
               "phase_seconds": {"moving": 0.5, "actor": 3.0, "rollout": 5.0, "inference": 1.0},
               "device_idle_fraction": 0.2345, "policy": "rlinf", "output_dir": "runs/a|b", "reshards": 5,
               "migrations": 2, "warnings": [{"kind": "flat_reward", "message": "reward never moved"}]}
    text = summary_markdown(summary, "MLflow run: [abc](http://h/#/experiments/1/runs/abc)")
    lines = text.splitlines()
    assert lines[0] == "# addition-dynamic" and "| what | value |" in lines
    for row in ("| policy | rlinf |", "| steps | 2 |", "| wall | 61.2 s |", "| mean step | 3.50 s |",
                "| reward, final | 0.375 (first step 0.250) |", "| held-out accuracy | 0.500 -> 0.562 |",
                "| time per phase (device-s) | generate 5.0, score 1.0, train 3.0, moving 0.5 |",
                "| device idle fraction | 0.23 |", "| reshards | 5 |", "| migrations | 2 |",
                "| warning: flat_reward | reward never moved |", "| output | `runs/a\\|b` |"):
        assert row in lines, row
    assert lines[-1] == "MLflow run: [abc](http://h/#/experiments/1/runs/abc)"
