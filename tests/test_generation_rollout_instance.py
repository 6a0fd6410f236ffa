"""Rollout instances: pull whole groups from one shared queue, emit each group once and as soon as it is done,
per-sample seeds from (run seed, step, group, sample), group migration between instances, typed signals."""

import random

import pytest

from tidal.engine.generation import EngineConfig, GenerationError, NativeEngine, SamplingParams, derive_seed
from tidal.engine.model import ModelArgs, Transformer, init_global_weights
from tidal.workers.rollout_instance import (
    GroupQueue,
    InstanceSignals,
    PromptGroup,
    RolloutInstance,
    migrate_groups,
    request_id,
)

ARGS = ModelArgs(vocab_size=31, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32,
                 max_seq_len=24)
PARAMS = SamplingParams(1.0, top_p=0.95, max_new_tokens=6, stop_token_ids=(2,))
GROUP_SIZE = 4


def model():
    m = Transformer(ARGS)
    m.load_global(init_global_weights(ARGS, 0))
    return m


def groups(n):
    rng = random.Random(0)
    return [PromptGroup(g, tuple(rng.randrange(ARGS.vocab_size) for _ in range(rng.randint(2, 6)))) for g in range(n)]


def instances(m, queue, out, k, width=3, clock=None):
    kw = {} if clock is None else {"clock": clock}
    return [RolloutInstance(f"r{i}", NativeEngine(m, EngineConfig(width)), queue, out.append, PARAMS, GROUP_SIZE,
                            run_seed=5, step=2, **kw) for i in range(k)]


def as_key(emitted):
    return {g.group_id: (g.prompt_ids, g.response_ids, tuple(s.logprobs for s in g.samples)) for g in emitted}


def test_instances_share_one_queue_and_emit_every_group_once_exactly():
    m = model()
    ref_out = []
    (solo,) = instances(m, GroupQueue(groups(10)), ref_out, 1)
    while not solo.done():
        solo.pump()
    queue, out = GroupQueue(groups(10)), []
    insts = instances(m, queue, out, 3)
    rng, moves, pulled_by = random.Random(4), 0, {}
    while not all(i.done() for i in insts):
        for inst in insts:
            before = set(inst.group_ids())
            inst.pump()
            for g in set(inst.group_ids()) - before:
                pulled_by.setdefault(g, inst.instance_id)
        src, dst = rng.sample(insts, 2)
        if src.group_ids() and rng.random() < 0.4:
            migrate_groups(src, dst, rng.sample(src.group_ids(), 1))
            moves += 1
    assert sorted(g.group_id for g in out) == list(range(10))  # each once
    assert as_key(out) == as_key(ref_out)  # same samples as one instance without migrations
    assert len(set(pulled_by.values())) == 3 and moves > 3  # no static split: everyone pulled; groups moved
    for g in out:
        assert len(g.samples) == GROUP_SIZE and g.policy_version == 0
        assert [s.request_id for s in g.samples] == [request_id(2, g.group_id, k) for k in range(GROUP_SIZE)]


def test_group_is_emitted_in_the_pump_that_finishes_it():
    m = model()
    out = []
    (inst,) = instances(m, GroupQueue(groups(3)), out, 1, width=8)
    seen_done = []
    while not inst.done():
        n_before = len(out)
        inst.pump()
        for g in out[n_before:]:
            seen_done.append(g.group_id)
            assert g.group_id not in inst.group_ids()
            assert all(s.finish_reason in ("stop", "length") for s in g.samples)
    assert sorted(seen_done) == [0, 1, 2]


def test_sample_seeds_come_from_run_step_group_and_index():
    assert derive_seed(5, 2, 7, 1) == derive_seed(5, 2, 7, 1)
    seeds = {derive_seed(5, s, g, k) for s in range(3) for g in range(5) for k in range(4)}
    assert len(seeds) == 60


def test_signals_are_a_typed_snapshot_with_a_recent_token_rate():
    m = model()
    now = [0.0]
    out = []
    queue = GroupQueue(groups(4))
    (inst,) = instances(m, queue, out, 1, width=2, clock=lambda: now[0])
    s0 = inst.signals()
    assert isinstance(s0, InstanceSignals) and s0.token_rate == 0.0 and s0.queue_remaining == 4
    made = []
    for _ in range(3):
        now[0] += 0.5
        made.append(inst.pump())
    s1 = inst.signals()
    assert s1.groups_in_progress >= 1 and s1.running_requests == 2 and s1.tokens_generated == sum(made) > 0
    assert s1.token_rate == pytest.approx((made[1] + made[2]) / 1.0)  # tokens between the 1st and 3rd sample
    assert s1.queue_remaining < 4


def test_migrating_unknown_groups_is_a_clear_error():
    m = model()
    queue, out = GroupQueue(groups(2)), []
    a, b = instances(m, queue, out, 2)
    a.pump()
    with pytest.raises(GenerationError, match="not in progress"):
        migrate_groups(a, b, [99])
