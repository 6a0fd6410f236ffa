"""A non-finite gradient norm or loss is never applied (`actor.on_nonfinite`): `stop` raises a TrainingError on
every rank of the layout with the state exactly as before the iter; `skip` drops the update and training goes
on exactly as if that iter had never been tried. Real gloo ranks, as in test_reshard."""

from dataclasses import replace

import pytest
import torch

from tidal.core.errors import TrainingError
from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout
from tidal.engine.testing import run_ranks

pytestmark = pytest.mark.usefixtures("shared_ray")

K = 2   # clean iters before the poisoned one


def _poisoned_iter(shard: ActorShard, it: int, rank: int, poison: str):
    """Iter `it` with rank 0's micro-batch losses made NaN or infinite; rank 1's stay finite."""
    import test_reshard as tr
    mbs, n = tr.iter_data(it)

    def loss_fn(model, mb, num_tokens):
        loss = nll_loss(model, mb, num_tokens)
        return loss * float(poison) if rank == 0 else loss
    return shard.train_iter(SharedQueue(mbs), loss_fn, n)


def _case(rank, world, layout_text, mode, poison):
    import test_reshard as tr
    groups = GroupCache()
    lay = Layout.parse(layout_text)
    clean = ActorShard(tr.ARGS, tr.HP, lay, rank, seed=tr.SEED, groups=groups)
    bad = ActorShard(tr.ARGS, replace(tr.HP, on_nonfinite=mode), lay, rank, seed=tr.SEED, groups=groups)
    tr.train(clean, range(K + 2))
    tr.train(bad, range(K))
    before = bad.local_tensors()
    try:
        report = _poisoned_iter(bad, K, rank, poison)
        outcome = ("skipped" if report is not None and report.skipped else "applied", "")
    except TrainingError as err:
        outcome = ("stopped", str(err))
    after = bad.local_tensors()
    unchanged = [k for k in before if k != "data_cursor" and not torch.equal(before[k], after[k])]
    if mode == "skip":   # then iters K and K+1 as the clean shard ran them: the same bits
        tr.train(bad, range(K, K + 2))
        final, want = bad.local_tensors(), clean.local_tensors()
        differ = [k for k in want if k != "data_cursor" and not torch.equal(final[k], want[k])]
    else:
        differ = []
    return outcome, unchanged, differ


@pytest.mark.parametrize("layout_text", ["tp=1,dp=2", "tp=2,dp=1"])
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_stop_raises_on_every_rank_and_changes_nothing(layout_text, poison):
    for rank, (outcome, changed, _) in enumerate(run_ranks(2, _case, layout_text, "stop", poison)):
        kind, message = outcome
        assert kind == "stopped", f"rank {rank}: {kind}"
        assert "actor.on_nonfinite" in message and f"optimizer step {K}" in message and "not applied" in message
        assert not changed, f"rank {rank} changed {changed}"


@pytest.mark.parametrize("layout_text", ["tp=1,dp=2", "tp=2,dp=1"])
def test_skip_drops_the_update_and_trains_on_as_if_never_tried(layout_text):
    for rank, (outcome, changed, differ) in enumerate(run_ranks(2, _case, layout_text, "skip", "nan")):
        assert outcome[0] == "skipped", f"rank {rank}: {outcome}"
        assert not changed, f"rank {rank}: the skipped iter changed {changed}"
        assert not differ, f"rank {rank}: after the skip, training differs from the clean run in {differ}"


def test_the_run_ends_with_the_step_the_device_and_the_checkpoint_named(tmp_path, capsys):
    """`tidal train` with a learning rate that overflows the weights: exit 2, one message naming the RL step,
    the optimizer step, the device that raised it and what to do; no traceback."""
    from tidal.cli.main import main
    # AdamW's first steps move every weight by about lr: 3e38 twice overflows fp32 (1e30 would not: RMSNorm
    # then maps the huge weights to zeros, a degenerate but finite model)
    # the actor on two ranks (the message names the device that raised), rollout and inference on one device each
    code = main(["train", "experiments/addition_dynamic.yaml", f"run.output_dir={tmp_path}", "actor.lr=3e38",
                 "warm_start.iters=0", "run.num_steps=3", "data.eval_size=8", "cluster.num_devices_per_node=4",
                 "cluster.component_placement={actor: 0-1, rollout: 2, inference: 3}", "--no-track"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "actor.on_nonfinite" in err and "RL step" in err and "raised on device" in err
    assert "no checkpoint was saved yet" in err and "Traceback" not in err
