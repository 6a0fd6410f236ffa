"""The typed worker endpoints on a real embedded Ray (CPU workers, gloo): the role facades of
`tidal.workers.endpoints` return their records, a call's positional arguments reach the worker, and the object
store (`put`, `get`) and `wait_ready` work without the caller importing Ray.

One Ray instance and one group of two workers serve the module: device 0 holds the actor, device 1 serves
rollout and inference (the actor's backend is built on both: its creation is collective over the world).
"""

from __future__ import annotations

import pytest
import torch
from training_equality import PARITY_REWARD

from tidal.core.config import build_config
from tidal.engine.datasets import DataPosition
from tidal.engine.grpo import count_response_tokens, flatten_groups
from tidal.engine.layout import Layout
from tidal.engine.model import compute_dtype, init_global_weights
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.pipeline.inputs import read_inputs
from tidal.pipeline.run import run_spec
from tidal.workers import probes
from tidal.workers.endpoints import Endpoints
from tidal.workers.errors import WorkerCallError
from tidal.workers.messages import HandoverReport, RankWeights, RolloutModel, RolloutReport
from tidal.workers.ray_env import connect, disconnect
from tidal.workers.rollout_instance import PromptGroup
from tidal.workers.runtime import WorkerGroup

ACTOR, ROLLOUT = 0, 1
DEVICES = [ACTOR, ROLLOUT]

TINY = {
    "run": {"num_steps": 1, "seed": 5},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 8, "max_running_requests": 8},
    "algorithm": {"group_size": 4, "n_minibatches": 1},
    "data": {"rollout_batch_size": 2},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},
}


@pytest.fixture(scope="module")
def group():
    session = connect()
    g = WorkerGroup.start(DEVICES, "cpu")
    try:
        yield g
    finally:
        g.shutdown()
        disconnect(session)
        import ray

        ray.shutdown()   # a later module may fork the test process: leave no Ray threads behind


@pytest.fixture(scope="module")
def run(group):
    """The workers set up for a tiny run, the actor on `ACTOR` from seeded weights put once in the object store."""
    cfg = build_config(TINY)
    inputs = read_inputs(cfg)
    spec = run_spec(cfg, inputs)
    calls = Endpoints.on(group)
    assert group.gather(calls.worker.setup(DEVICES, spec), timeout=120) == DEVICES
    weights = init_global_weights(spec.args, 0)
    ref = group.put(weights)
    built = group.gather(calls.actor.init(DEVICES, Layout(1, 1, (ACTOR,)), ref), timeout=120)
    assert all(isinstance(b, str) and b for b in built)
    return calls, inputs, weights, ref


@pytest.mark.timeout(120)
def test_put_get_and_wait_ready(group):
    ref = group.put({"a": torch.arange(3)})
    assert torch.equal(group.get(ref, timeout=30)["a"], torch.arange(3))
    assert group.wait_ready([], timeout=0) == []
    slow = group.submit(ACTOR, probes.sleep, seconds=3.0)
    fast = group.submit(ROLLOUT, probes.sleep, seconds=0.0)
    assert group.wait_ready([slow, fast], timeout=30) == [fast]   # the first to end, before the slow one
    assert group.wait_ready([slow], timeout=0) == []              # never waits with timeout 0
    assert group.wait_ready([slow, fast], timeout=30, num_returns=2) == [slow, fast]   # in the order given
    assert group.gather([slow, fast]) == [ACTOR, ROLLOUT]
    failed = group.submit(ROLLOUT, probes.fail, message="boom")
    assert group.wait_ready([failed], timeout=30) == [failed]    # a failure has ended too: gather raises it
    with pytest.raises(WorkerCallError, match="boom"):
        group.gather([failed])


@pytest.mark.timeout(120)
def test_positional_arguments_reach_the_worker(group):
    group.gather([group.submit(ROLLOUT, probes.put_state, "key", 7.5)])
    assert group.gather(group.submit_all(probes.add_to_state, [ROLLOUT], "key", 0.5)) == [8.0]
    assert group.call(ROLLOUT, probes.get_state, 30, "key") == 8.0   # `timeout` comes before the function's own


@pytest.mark.timeout(300)
def test_facades_return_their_records(group, run):
    calls, inputs, weights, ref = run
    # the actor's weights: one TP rank's shard (TP 1: the whole weights), in the compute dtype
    shards = group.gather(calls.actor.weights(DEVICES))
    assert shards[1] is None and isinstance(shards[0], RankWeights) and shards[0].tp_rank == 0
    dtype = compute_dtype("auto", torch.device("cpu"))
    assert shards[0].tensors.keys() == weights.keys()
    assert all(torch.equal(shards[0].tensors[k], v.to(dtype)) for k, v in weights.items())

    # rollout from the weights in the object store; inference scores with the rollout engine's model
    assert group.gather([calls.rollout.start(ROLLOUT, ref, version=0, step=0),
                         calls.inference.load(ROLLOUT, RolloutModel(0), version=0)]) == ["1", 0]
    prompts, _ = inputs.source.take(2, DataPosition())
    todo = [PromptGroup(i, ids, label) for i, (ids, label) in enumerate(prompts)]
    done: list[RolloutGroup] = []
    for seq in range(200):
        finished, report = group.gather([calls.rollout.run_slice(ROLLOUT, todo, budget_s=0.5, seq=seq)])[0]
        todo = []
        assert isinstance(report, RolloutReport)
        done += finished
        if len(done) == 2:
            break
    assert sorted(g.group_id for g in done) == [0, 1] and all(isinstance(g, RolloutGroup) for g in done)
    assert group.gather(calls.rollout.holding([ROLLOUT])) == [[]]
    scored = group.gather([calls.inference.score(ROLLOUT, done)])[0]
    assert [s.group_id for s in scored] == [g.group_id for g in done]
    assert all(isinstance(s, ScoredGroup) and s.inference_version == 0 for s in scored)

    # one optimizer step from the samples put once; then the device handed to generation and back
    samples = flatten_groups(scored)
    metrics = group.gather(calls.actor.train_iter([ACTOR], group.put(samples), count_response_tokens(samples)))
    assert metrics[0] is not None and metrics[0]["actor/microbatches"] >= 1
    off = group.gather([calls.actor.offload(ACTOR, optimizer=True, grad=True, weight=True)])[0]
    back = group.gather([calls.actor.onload(ACTOR)])[0]
    assert isinstance(off, HandoverReport) and isinstance(back, HandoverReport)
    assert off.bytes > 0 and back.bytes > 0 and off.actor_resident == 0 < back.actor_resident
    assert off.phase_peak is None and off.measured().keys() == {"bytes", "seconds", "actor_resident"}   # CPU
    group.gather([calls.inference.release(ROLLOUT), calls.rollout.release(ROLLOUT)])
