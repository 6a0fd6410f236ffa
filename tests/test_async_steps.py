"""Asynchronous steps (`algorithm.max_staleness`, tidal/pipeline/ahead.py) in real runs on CPU virtual devices:
rollout generates later steps' groups while the actor trains, every sample within the staleness bound, every
group of every step trained once, and the run trains (a reward that pays part of every group)."""

import pytest
from training_equality import PARITY_REWARD, assert_trained, start_weights, trained

from tidal.core.config import build_config
from tidal.core.errors import ConfigError
from tidal.pipeline.run import TrainingRun

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

#: rollout on two devices of its own; 4 slots per instance, so a step's groups run in waves and the instances
#: still hold later work when the step ends
ASYNC = {
    "run": {"num_steps": 3, "seed": 4},
    "cluster": {"num_devices_per_node": 4, "component_placement": {"actor": "0", "rollout": "1-2",
                                                                    "inference": "3"}},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 16, "max_running_requests": 4},
    "algorithm": {"group_size": 4, "n_minibatches": 4, "max_staleness": 1, "rollout_is": "token"},
    "data": {"rollout_batch_size": 16, "eval_size": 8},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},
}


def _run(tmp_path, name, overrides=()):
    cfg = build_config(ASYNC, [f"run.output_dir={tmp_path}", f"run.name={name}", *overrides])
    run = TrainingRun(cfg, tmp_path / name)
    try:
        run.open()
        start = start_weights(run)
        steps = []
        for _ in range(cfg.run.num_steps):
            metrics = run.step()
            steps.append((metrics, dict(run.pipe.step_state.scored)))
        run.finish()
        return trained(run, start), steps, run.pipe
    finally:
        run.close()


@pytest.mark.parametrize("partial", ["keep", "recompute"])
def test_async_steps_stay_within_the_staleness_bound_and_train(tmp_path, partial):
    out, steps, pipe = _run(tmp_path, partial, [f"rollout.partial={partial}"])
    assert_trained(out)
    ahead = 0
    for step, (metrics, scored) in enumerate(steps):
        assert sorted(scored) == list(range(16)), (step, sorted(scored))   # every group once
        for g in scored.values():
            assert g.step == step and g.inference_version == step   # scored under the weights the step trains from
            for i in range(g.group_size):
                versions = g.token_versions(i)
                assert len(versions) == len(g.response_ids[i])
                assert all(step - 1 <= v <= step for v in versions), (step, g.group_id, versions)
                assert versions == sorted(versions)   # a sample's tokens only move to newer weights
        ahead += int(metrics.get("rollout/groups_generated_ahead", 0))
        lags = {k: v for k, v in metrics.items() if k.startswith("grpo/samples_at_lag_")}
        assert sum(lags.values()) == 16 * 4 and set(lags) <= {"grpo/samples_at_lag_0", "grpo/samples_at_lag_1"}
        assert metrics["grpo/version_lag_max"] <= 1
    # rollout ran ahead: later steps' groups were generated while earlier steps trained (under older weights)
    assert ahead > 0, [m.get("rollout/groups_generated_ahead") for m, _ in steps]
    assert sum(m.get("grpo/samples_at_lag_1", 0) for m, _ in steps) > 0
    assert pipe.ahead is not None and not pipe.ahead.steps   # nothing generated past the run's last step


def test_async_steps_are_refused_where_they_cannot_run():
    with pytest.raises(ConfigError, match="cluster.auto_scheduler: false"):
        build_config(ASYNC, ["cluster.auto_scheduler=true"])
    hybrid = {**ASYNC, "cluster": {"num_devices_per_node": 4,
                                   "component_placement": {"actor": "0", "rollout,inference": "1-3"}}}
    with pytest.raises(ConfigError, match="devices of its own"):
        build_config(hybrid)
