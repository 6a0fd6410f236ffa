"""Warnings a user needs: a step with zero advantage everywhere, a warm start short of its plateau, a reward
that never moved. Each kind is raised once, and reaches the logger, the MLflow run (a tag) and the summary."""

import pytest

from tidal.pipeline.run_warnings import RunWarnings

pytestmark = pytest.mark.usefixtures("shared_ray")


def test_each_kind_is_raised_once_and_only_when_it_holds():
    w = RunWarnings()
    assert w.after_step(0, {"grpo/zero_adv_group_frac": 0.5}) == []
    first = w.after_step(1, {"grpo/zero_adv_group_frac": 1.0})
    assert [x.kind for x in first] == ["zero_advantage"] and "step 1" in first[0].message
    assert w.after_step(2, {"grpo/zero_adv_group_frac": 1.0}) == []   # once
    assert w.at_finish([0.2, 0.3]) == [] and w.at_finish([0.4]) == []
    assert [x.kind for x in w.at_finish([0.0, 0.0, 0.0])] == ["flat_reward"]
    meta = {"history": [{"iter": 40, "heldout_accuracy": 0.2}], "heldout_accuracy": 0.2}
    assert w.after_warm_start(meta, None) == [] and w.after_warm_start({**meta, "heldout_accuracy": 0.6}, 0.5) == []
    warm = w.after_warm_start(meta, 0.5)
    assert [x.kind for x in warm] == ["warm_start"] and "40 iters" in warm[0].message


@pytest.mark.slow
def test_a_run_that_learns_nothing_says_so(tmp_path):
    """A random-init model on the built-in task earns reward 0 in every group: every step has zero advantage
    and the reward never moves. The run says so once each: to `on_warning`, as MLflow tags, in the summary."""
    from tests.test_token_shapes import ONE_DEVICE
    from tidal.core.config import build_config
    from tidal.pipeline.run import run_training
    from tidal.tracking import NullSink
    task_reward = {k: v for k, v in ONE_DEVICE.items() if k != "reward"}   # the task's exact verifier
    cfg = build_config(task_reward, [f"run.output_dir={tmp_path}", "run.name=flat", "rollout.temperature=0"])
    sink = NullSink()
    sink.start_run("flat", {})
    seen = []
    summary = run_training(cfg, tmp_path / "flat", sink, on_warning=seen.append)
    assert set(summary.reward_per_step) == {0.0}
    assert [w.kind for w in seen] == ["zero_advantage", "flat_reward"]
    assert [w["kind"] for w in summary.warnings] == ["zero_advantage", "flat_reward"]
    tags = next(iter(sink.runs.values()))["tags"]
    assert tags["warning.zero_advantage"].startswith("step 0:") and "warning.flat_reward" in tags
