"""Partial rollout in the native engine (`NativeEngine.update_weights(in_flight=...)`): requests in flight continue
under new weights, each token recording the version it was sampled with.

`recompute` is checked against the models themselves: every log-prob before the switch is the old weights' and
every one after it the new weights' (a plain forward over the whole sequence, no KV cache). `keep` continues on
the old weights' KV: its tokens before the switch are the unswitched run's, bit for bit, and a request migrated
after the switch continues exactly. Per-token versions survive migration and the wire format."""

import dataclasses

import pytest
import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import EngineConfig, GenerationError, NativeEngine, Request, SamplingParams
from tidal.engine.generation.migration import migrate, states_from_bytes, states_to_bytes
from tidal.engine.generation.protocol import EngineBusyError
from tidal.engine.model import ModelArgs, Transformer, init_global_weights

ARGS = ModelArgs(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=40)
SAMPLED = SamplingParams(1.0, max_new_tokens=12)
W0, W1 = init_global_weights(ARGS, 0), init_global_weights(ARGS, 1)
SWITCH_AFTER = 4   # engine steps under the old weights


def _model(weights) -> Transformer:
    m = Transformer(ARGS)
    m.load_global(weights)
    return m


def _requests(n=4):
    g = torch.Generator().manual_seed(5)
    return [Request(f"p{i}", tuple(torch.randint(0, ARGS.vocab_size, (3 + i,), generator=g).tolist()), SAMPLED,
                    seed=40 + i) for i in range(n)]


def _finish(engines, out):
    while any(e.has_work() for e in engines):
        for e in engines:
            out.update({ev.request_id: ev.result for ev in e.step() if ev.finished})
    return out


def _switched(in_flight, migrate_after=False):
    """The requests run SWITCH_AFTER steps under W0, then the engine takes W1 as version 1 with them in flight;
    `migrate_after`: one more step, then every request moves (KV) to a second engine at version 1."""
    e = NativeEngine(_model(W0), EngineConfig(8))
    for r in _requests():
        e.add(r)
    out = {}
    for _ in range(SWITCH_AFTER):
        out.update({ev.request_id: ev.result for ev in e.step() if ev.finished})
    e.update_weights(W1, 1, in_flight=in_flight)
    engines = [e]
    if migrate_after:
        e.step()
        other = NativeEngine(_model(W1), EngineConfig(8), policy_version=1)
        migrate(e, other)
        engines.append(other)
    return _finish(engines, out)


def _reference_logprobs(weights, prompt, tokens):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        lp = _model(weights).token_logprobs(ids)[0]
    return lp[len(prompt) - 1:]


@pytest.mark.parametrize("in_flight", ["keep", "recompute"])
def test_tokens_record_the_version_they_were_sampled_with(in_flight):
    out = _switched(in_flight)
    assert len(out) == 4
    for r in out.values():
        (start0, v0), (switch, v1) = r.version_starts
        assert (start0, v0, v1, r.policy_version) == (0, 0, 1, 0), r.version_starts
        assert 0 < switch < len(r.token_ids), r.version_starts


def test_recompute_samples_each_token_under_its_versions_weights():
    for r in _switched("recompute").values():
        switch = r.version_starts[1][0]
        old = _reference_logprobs(W0, r.prompt_ids, r.token_ids)
        new = _reference_logprobs(W1, r.prompt_ids, r.token_ids)
        got = torch.tensor(r.logprobs)
        torch.testing.assert_close(got[:switch], old[:switch], atol=2e-5, rtol=0)
        torch.testing.assert_close(got[switch:], new[switch:], atol=2e-5, rtol=0)


def test_keep_continues_on_the_old_kv_and_migrates_exactly():
    e = NativeEngine(_model(W0), EngineConfig(8))
    for r in _requests():
        e.add(r)
    unswitched = _finish([e], {})
    keep, recompute = _switched("keep"), _switched("recompute")
    for rid, r in keep.items():
        switch = r.version_starts[1][0]
        assert r.token_ids[:switch] == unswitched[rid].token_ids[:switch]
        assert r.logprobs[:switch] == unswitched[rid].logprobs[:switch]
    # the stale KV shows: kept and recomputed continuations differ somewhere after the switch
    assert any(keep[rid].logprobs[k.version_starts[1][0]:] != recompute[rid].logprobs[k.version_starts[1][0]:]
               for rid, k in keep.items())
    moved = _switched("keep", migrate_after=True)
    for rid, r in keep.items():
        assert (moved[rid].token_ids, moved[rid].logprobs, moved[rid].version_starts) == \
            (r.token_ids, r.logprobs, r.version_starts)
        assert moved[rid].num_migrations == 1


def test_versions_travel_with_a_state_and_its_current_version_decides_where_it_may_continue():
    e = NativeEngine(_model(W0), EngineConfig(8))
    for r in _requests(2):
        e.add(r)
    for _ in range(SWITCH_AFTER):
        e.step()
    e.update_weights(W1, 1, in_flight="keep")
    e.step()
    states = e.export_state(e.request_ids())
    assert all(st.policy_version == 0 and st.current_version == 1 for st in states)
    back = states_from_bytes(states_to_bytes(states))
    assert [st.version_starts for st in back] == [st.version_starts for st in states]
    old = NativeEngine(_model(W0), EngineConfig(8))   # version 0: the states' next token needs version 1
    with pytest.raises(GenerationError, match="sampled with policy version 1 but this engine holds version 0"):
        old.import_state([st.without_kv() for st in states])
    new = NativeEngine(_model(W1), EngineConfig(8), policy_version=1)
    new.import_state([st.without_kv() for st in back])
    assert set(new.request_ids()) == {st.request_id for st in states}


def test_an_update_with_requests_in_flight_needs_a_mode_and_no_migration_in_progress():
    e = NativeEngine(_model(W0), EngineConfig(8))
    for r in _requests(2):
        e.add(r)
    e.step()
    with pytest.raises(EngineBusyError, match="in flight"):
        e.update_weights(W1, 1)
    e.export_state(["p0"])
    with pytest.raises(EngineBusyError, match="commit or cancel"):
        e.update_weights(W1, 1, in_flight="keep")
    e.cancel_export(["p0"])
    e.update_weights(W1, 1, in_flight="keep")
    assert e.policy_version == 1


def _replayed(original, in_flight, steps_before_update):
    """The original's requests with its version_starts as their schedules, on a fresh engine: the engine is
    stepped `steps_before_update` times (requests reaching their switch wait there), then stepped until every
    scheduled request waits, then takes W1; the rest runs to the end."""
    e = NativeEngine(_model(W0), EngineConfig(8))
    for r in _requests():
        e.add(dataclasses.replace(r, version_schedule=original[r.request_id].version_starts))
    out = {}
    for _ in range(steps_before_update):
        out.update({ev.request_id: ev.result for ev in e.step() if ev.finished})
    while e.num_held() < len(e.request_ids()):
        out.update({ev.request_id: ev.result for ev in e.step() if ev.finished})
    e.update_weights(W1, 1, in_flight=in_flight)
    return _finish([e], out)


@pytest.mark.parametrize("in_flight", ["keep", "recompute"])
def test_a_partial_rollout_replayed_with_its_schedule_is_the_same_bit_for_bit(in_flight):
    original = _switched(in_flight)
    for steps in (1, SWITCH_AFTER, 20):   # the update comes earlier than, as, or later than the original's
        replay = _replayed(original, in_flight, steps)
        assert set(replay) == set(original)
        for rid, r in original.items():
            assert (replay[rid].token_ids, replay[rid].logprobs, replay[rid].version_starts) == \
                (r.token_ids, r.logprobs, r.version_starts), (rid, steps)


def test_a_schedule_is_checked_and_holds_back_the_update_until_every_request_reaches_it():
    with pytest.raises(TidalError, match="version_schedule"):
        Request("x", (1, 2), SAMPLED, version_schedule=((1, 0),))
    with pytest.raises(TidalError, match="version_schedule"):
        Request("x", (1, 2), SAMPLED, version_schedule=((0, 1), (3, 1)))
    r = Request("x", (1, 2), SAMPLED, version_schedule=((0, 0), (3, 1)))
    assert [r.version_due(i) for i in range(5)] == [0, 0, 0, 1, 1]
    assert Request.from_meta(r.to_meta()) == r
    e = NativeEngine(_model(W0), EngineConfig(8))
    e.add(r)
    e.step()
    with pytest.raises(EngineBusyError, match="scheduled under version 0 still to sample"):
        e.update_weights(W1, 1, in_flight="keep")
    for _ in range(6):
        e.step()
    assert e.num_held() == 1 and e.has_work()   # three tokens, then it waits for version 1
    e.update_weights(W1, 1, in_flight="keep")
    (res,) = _finish([e], {}).values()
    assert res.version_starts == ((0, 0), (3, 1))


def test_a_groups_token_versions_and_the_steps_lag_metrics():
    from tidal.engine.grpo import step_metrics
    from tidal.engine.records import RecordError, RolloutGroup

    lp = (torch.zeros(4), torch.zeros(2), torch.zeros(3))
    g = RolloutGroup(0, 5, (1, 2), ((3, 4, 5, 6), (7, 8), (9, 9, 9)), lp, (1.0, 0.0, 1.0), 4,
                     ("eos", "eos", "length"), (((0, 4), (2, 5)), ((0, 5),), ()))
    assert [g.token_versions(i) for i in range(3)] == [[4, 4, 5, 5], [5, 5], [4, 4, 4]]
    m = step_metrics([g.scored(lp, 5)])
    assert (m["grpo/samples_at_lag_0"], m["grpo/samples_at_lag_1"]) == (1.0, 2.0)
    assert m["grpo/version_lag_max"] == 1.0
    assert m["grpo/version_lag_tokens_mean"] == pytest.approx(5 / 9)
    with pytest.raises(RecordError, match="version_starts"):
        RolloutGroup(0, 5, (1, 2), ((3,), (4,)), (torch.zeros(1), torch.zeros(1)), (1.0, 0.0), 4, ("eos", "eos"),
                     (((0, 4),),))
