"""Collocated and hybrid placements on real device workers (Ray, gloo): the components sharing devices take turns
there, the actor's state is handed over to host memory while its devices generate, and every shared run ends with
the parameters of the disaggregated static run on the same seeds and data, bit for bit."""

from dataclasses import replace

import pytest
import torch
from training_equality import PARITY_REWARD, assert_same_training, start_weights, trained

from scheduler import from_run
from scheduler.costs import preset
from tidal.core.config import build_config
from tidal.core.devices import Owner
from tidal.engine.actor import ActorShard
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, init_global_weights
from tidal.engine.optim import OptimConfig
from tidal.engine.testing import run_ranks
from tidal.pipeline.run import TrainingRun

pytestmark = pytest.mark.usefixtures("shared_ray")

BASE = {
    "run": {"num_steps": 2, "seed": 5},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64,
              "max_seq_len": 32},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 12, "max_running_requests": 8},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},   # the random model's groups are half rewarded: every iter trains
}

OFFLOAD_ALL = ["actor.offload_optimizer=true", "actor.offload_grad=true", "actor.offload_weight=true"]

#: name -> (devices, placement, extra overrides)
PLACEMENTS = {
    "disaggregated": (4, {"actor": "0-1", "rollout": "2", "inference": "3"}, []),
    "collocated": (2, {"actor,rollout,inference": "0-1"}, OFFLOAD_ALL),
    "actor+inference|rollout": (3, {"actor,inference": "0-1", "rollout": "2"}, []),
    "actor+rollout|inference": (3, {"actor,rollout": "0-1", "inference": "2"}, ["actor.offload_optimizer=true"]),
    "one device": (1, {"actor,rollout,inference": "0"}, ["actor.offload_optimizer=true", "actor.offload_grad=true"]),
    "disaggregated tp2": (4, {"actor": "0-1", "rollout": "2", "inference": "3"}, ["actor.tensor_parallel_size=2"]),
    "collocated tp2": (2, {"actor,rollout,inference": "0-1"}, ["actor.tensor_parallel_size=2", *OFFLOAD_ALL]),
}


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def _cfg(tmp_path, name, extra=()):
    n, placement, overrides = PLACEMENTS[name]
    base = {**BASE, "cluster": {"num_devices_per_node": n, "component_placement": placement}}
    return build_config(base, [f"run.output_dir={tmp_path}", f"run.name={_slug(name)}", *overrides, *extra])


def _train(tmp_path, name, steps=None, resume_from=None, extra=()):
    """(the run, the checkpoint after `steps` steps, or None when it ran to the end, `Trained` at the end)"""
    cfg = _cfg(tmp_path, name, extra)
    run = TrainingRun(cfg, tmp_path / _slug(name))
    try:
        run.open(resume_from=resume_from)
        start = start_weights(run)
        for _ in range(steps if steps is not None else cfg.run.num_steps - run.next_step):
            run.step()
        if steps is not None:
            return run, run.checkpoint(), None
        run.finish()
        return run, None, trained(run, start)
    finally:
        run.close()


def _spans(run, role, what=None):
    return [s for s in run.pipe.timeline.busy if s.role == role and (what is None or s.what == what)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The disaggregated static run every shared run must equal."""
    run, _, ref = _train(tmp_path_factory.mktemp("ref"), "disaggregated")
    return run.rewards, ref, run.out_dir


@pytest.mark.slow
@pytest.mark.parametrize("name", ["collocated", "actor+inference|rollout", "actor+rollout|inference", "one device"])
def test_a_shared_run_equals_the_disaggregated_static_run(tmp_path, name, reference):
    ref_rewards, ref, _ = reference
    run, _, shared = _train(tmp_path, name)
    assert run.rewards == ref_rewards
    assert_same_training(ref, shared)
    events = run.pipe.cluster.events
    _, placement, _ = PLACEMENTS[name]
    shared = sorted({d for key, ids in placement.items() if "," in key
                     for d in range(int(ids.split("-")[0]), int(ids.split("-")[-1]) + 1)})
    assert run.pipe.ledger.owned(Owner.SHARED) == tuple(shared)
    share = run.pipe.sharing
    gen = _spans(run, "rollout", "generate")
    if share.actor_rollout:
        # in turn: no iter starts before its step's last generated group came back; the state was handed over
        for step in range(2):
            last_gen = max(s.t1 for s in gen if s.t0 >= _step_start(events, step) and s.t1 <= _step_end(events, step))
            first_iter = min(s.t0 for s in _spans(run, "actor") if s.what.startswith("iter")
                             and _step_start(events, step) <= s.t0 <= _step_end(events, step))
            assert first_iter >= last_gen
        hand = [e for e in events if e["kind"] == "handover"]
        to_train = [e for e in hand if e["direction"] == "to_training"]
        to_gen = [e for e in hand if e["direction"] == "to_generation"]
        assert [e["step"] for e in to_train] == [0, 1] and [e["step"] for e in to_gen] == [0, 1, 2]
        offloaded = [k for k, v in share.offloads.items() if v]
        assert offloaded and all(e["bytes"] > 0 for e in hand), hand
        if share.offload_weight and share.offload_optimizer and share.offload_grad:   # nothing left on the device
            assert all(e["actor_resident"] == 0 for e in to_gen), to_gen
    if share.rollout_inference:   # scoring waits for the whole step's generation (the KV caches go first)
        for step in range(2):
            lo, hi = _step_start(events, step), _step_end(events, step)
            last_gen = max(s.t1 for s in gen if lo <= s.t0 and s.t1 <= hi)
            assert all(s.t0 >= last_gen for s in _spans(run, "inference", "score") if lo <= s.t0 <= hi)
    syncs = [e for e in events if e["kind"] == "weight_sync"]
    engines_on_actor = sorted(set(run.pipe.placement.homes.actor.devices) & set(run.pipe.placement.engines))
    assert all(e["local"] == engines_on_actor for e in syncs), syncs   # a local copy, no trip through the driver
    if name == "collocated":   # the run's folder is enough to predict each step, phase by phase
        _predicted_from_its_folder(run.out_dir, "shared", ("rollout", "scoring", "training", "handover", "sync"))


def _predicted_from_its_folder(folder, placement, phases):
    rec = from_run.load(folder)
    assert [s["step"] for s in rec.steps] == [0, 1]
    assert all(len(s["response_lengths"]) == rec.cfg.data.rollout_batch_size for s in rec.steps)
    rep = from_run.predict(rec, preset("cpu"), learn=True)
    assert rep["placement"] == placement and [r["step"] for r in rep["steps"]] == [1]
    (row,) = rep["steps"]
    assert set(row["predicted"]) == {*phases, "step"}
    assert all(row["measured"][p] > 0 and row["predicted"][p] > 0 for p in row["predicted"]), row


def test_a_disaggregated_run_is_predicted_from_its_folder(reference):
    _predicted_from_its_folder(reference[2], "disaggregated", ("rollout",))


def _step_start(events, step):
    return min(e["time"] for e in events if e.get("step") == step and e["kind"] in ("iter", "handover"))  \
        if step else 0.0


def _step_end(events, step):
    return max(e["time"] for e in events if e["kind"] == "weight_sync" and e["step"] == step)


@pytest.mark.slow
def test_a_collocated_run_resumes_exactly(tmp_path, reference):
    """Checkpoint after step 1 of a collocated run with every offload on (the state is saved from host memory),
    resume in a new run: it ends where the uninterrupted runs end."""
    ref_rewards, ref, _ = reference
    _, ckpt, _ = _train(tmp_path, "collocated", steps=1)
    run, _, resumed = _train(tmp_path / "resumed", "collocated", resume_from=ckpt)
    assert run.rewards == ref_rewards[1:]
    assert_same_training(ref, resumed)
    assert any(e["kind"] == "resume" for e in run.pipe.cluster.events)


@pytest.mark.slow
def test_a_tp2_actor_on_shared_devices_hands_its_engines_a_gathered_replica(tmp_path):
    """Actor TP 2 collocated on 2 devices: at every step end its two shards are all-gathered on both devices and
    the engines there load them in place; it ends as the disaggregated TP 2 run does (TP changes the reduction
    order, so the reference has the same TP)."""
    ref_run, _, ref = _train(tmp_path, "disaggregated tp2")
    run, _, shared = _train(tmp_path, "collocated tp2")
    assert run.rewards == ref_run.rewards
    assert_same_training(ref, shared)
    syncs = [(e["local"], e["remote"]) for e in run.pipe.cluster.events if e["kind"] == "weight_sync"]
    assert syncs == [([0, 1], [])] * 2, syncs
    assert {e["tp"] for e in run.pipe.cluster.events if e["kind"] == "iter"} == {2}


def test_auto_scheduler_refuses_a_shared_placement_naming_what_it_needs():
    from tidal.core.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        build_config({**BASE, "cluster": {"num_devices_per_node": 2, "auto_scheduler": True,
                                          "component_placement": {"actor,rollout,inference": "0-1"}}})
    e = err.value
    assert e.field == "cluster.component_placement" and "exactly one" in e.problem
    assert "auto_scheduler: false" in e.fix


# ---- the hand-over itself --------------------------------------------------------------------------------------
ARGS = ModelArgs(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                 max_seq_len=16)


def _trained_shard() -> ActorShard:
    return ActorShard(ARGS, OptimConfig(lr=1e-2, warmup_iters=0, total_iters=10), Layout(1, 1, (0,)), 0,
                      weights=init_global_weights(ARGS, 0))


def _offload_rank(rank: int, world: int, keys: dict) -> dict:
    from tidal.engine.actor import SharedQueue, nll_loss
    ids = torch.randint(0, ARGS.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))

    def train(shard, n):
        for _ in range(n):
            shard.train_iter(SharedQueue([ids[:2], ids[2:]]), lambda m, b, t: nll_loss(m, b, t), 40)

    ref, shard = _trained_shard(), _trained_shard()
    train(ref, 3)
    train(shard, 1)
    before = shard.local_tensors()
    out = {"moved": shard.offload(**keys), "resident": shard.resident_bytes(), "full": ref.resident_bytes()}
    try:
        train(shard, 1)
    except RuntimeError as err:
        out["refused"] = str(err)
    out["again"] = shard.offload(**keys)   # what is off already stays off
    shard.onload()
    after = shard.local_tensors()
    out["restored"] = set(before) == set(after) and all(torch.equal(before[k], after[k]) for k in before)
    train(shard, 2)
    out["equal"] = all(torch.equal(v, shard.local_tensors()[k]) for k, v in ref.local_tensors().items())
    return out


@pytest.mark.parametrize("keys", [dict(optimizer=True, grad=False, weight=False),
                                  dict(optimizer=False, grad=True, weight=False),
                                  dict(optimizer=True, grad=True, weight=True)])
def test_offload_then_onload_restores_the_state_bit_for_bit_and_training_goes_on(keys):
    out = run_ranks(1, _offload_rank, keys)[0]
    assert out["moved"] > 0 and out["resident"] < out["full"] and out["again"] == 0, out
    assert "onload first" in out.get("refused", ""), out
    assert out["restored"] and out["equal"], out


def _replica_rank(rank: int, world: int, vocab: int) -> dict:
    args = replace(ARGS, vocab_size=vocab)
    shard = ActorShard(args, OptimConfig(), Layout(2, world // 2, tuple(range(world))), rank,
                       weights=init_global_weights(args, 0))
    return shard.gather_replica()


def test_gather_replica_assembles_the_global_weights_on_every_tp_rank():
    """TP 2 x DP 2 with an uneven vocab split (41 rows): every rank of the layout ends with the global weights."""
    outs = run_ranks(4, _replica_rank, 41)
    want = init_global_weights(replace(ARGS, vocab_size=41), 0)
    for out in outs:
        assert set(out) == set(want)
        for k, v in want.items():
            assert torch.equal(out[k], v), k


def test_validate_prints_the_mode_and_the_phase_plan_of_shared_devices(tmp_path, capsys):
    import yaml

    from tidal.cli import main as cli
    path = tmp_path / "hybrid.yaml"
    path.write_text(yaml.safe_dump({**BASE, "cluster": {"num_devices_per_node": 8, "component_placement": {
        "actor,inference": "0-3", "rollout": "4-7"}}, "actor": {**BASE["actor"], "offload_optimizer": True}}))
    assert cli.main(["validate", str(path), "--no-track"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "hybrid placement on 8 devices" in out and "static hybrid placement; each step:" in out
    assert "1. generate: rollout on 4-7, streaming groups to the others" in out
    assert "2. score: inference on 0-3 as groups arrive, in turn with training" in out
    assert "4. weight sync: a local copy on 0-3" in out and "through the object store to 4-7" in out
