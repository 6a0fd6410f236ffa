"""Checkpoints on real gloo worlds: save at layout A, load at A (bitwise identical state), at B (bitwise equal to
the in-memory reshard A -> B), training on after a load equals training on uninterrupted; a crash at every write
phase leaves the previous generation loadable; a flipped byte or another model's checkpoint is a clear error and
changes nothing.

One world run per size covers many cases (starting a world costs ~20 s on the 2-core machine); rank bodies
compare inside the ranks and return small values. The pure tests read the files that run left behind.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from training_equality import PARITY_REWARD, assert_same_training, start_weights, trained

from tidal.core.errors import TidalError
from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
from tidal.engine.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointMeta,
    check_model,
    generations,
    latest,
    load_actor,
    load_moves,
    read_manifest,
    save_actor,
    verify,
)
from tidal.engine.datasets import DataPosition
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, param_specs
from tidal.engine.optim import OptimConfig, ZeroShape
from tidal.engine.reshard import FaultInjected
from tidal.engine.testing import run_ranks

pytestmark = pytest.mark.usefixtures("shared_ray")

# as tests/test_reshard.py: TP 1, 2, 4 possible; vocab 23 and SwiGLU width 40 split unevenly; tiny.
ARGS = ModelArgs(vocab_size=23, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=4,
                 intermediate_size=40, max_seq_len=12)
OTHER = replace(ARGS, intermediate_size=48)
HP = OptimConfig(lr=1e-2, warmup_iters=1, total_iters=8, grad_clip=0.5, weight_decay=0.01)
SEED = 3
K = 2  # iters before the checkpoint


def iter_data(it: int, n_mb: int = 5):
    g = torch.Generator().manual_seed(1000 + it)
    mbs = [torch.randint(0, ARGS.vocab_size, (2, 8), generator=g) for _ in range(n_mb)]
    return mbs, sum(m.shape[0] * (m.shape[1] - 1) for m in mbs)


def train(shard: ActorShard, its) -> None:
    for it in its:
        mbs, n = iter_data(it)
        shard.train_iter(SharedQueue(mbs), nll_loss, n)


def diff(a: dict, b: dict) -> list[str]:
    return sorted(set(a) ^ set(b)) + [k for k in a if k in b and not torch.equal(a[k], b[k])]


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def layouts_case(rank, root, a_text, b_texts, train_on):
    """Train K iters at A, save. Load at A and at every B into fresh shards (at their init state, K iters behind)
    and compare with the trained shard (resharded in memory to B). For `train_on` layouts, train K
    more iters after the load and compare with the uninterrupted shard (bitwise; max abs diff reported)."""
    groups = GROUPS
    a = Layout.parse(a_text)
    s = ActorShard(ARGS, HP, a, rank, seed=SEED, groups=groups)
    train(s, range(K))
    save_actor(s, root, CheckpointMeta(step=K, data_pos=32, policy_version=K))
    dist.barrier()
    gen = latest(root)
    out = {"gen": gen.name if gen else None}
    for b_text in [a_text] + list(b_texts):
        b = Layout.parse(b_text)
        fresh = ActorShard(ARGS, HP, a, rank, seed=SEED, groups=groups)
        m = load_actor(fresh, gen, b)
        if b != a:
            s.reshard(b)
        out[f"load {b_text}"] = diff(s.local_tensors(), fresh.local_tensors())
        out[f"meta {b_text}"] = (m.meta.step, m.meta.data_pos, m.meta.policy_version, fresh.layout == b)
        if b != a:
            s.reshard(a)
        fresh.free()
    ref = s.state_dict_global() if train_on else None
    if train_on:
        train(s, range(K, 2 * K))
        ref = s.state_dict_global()
    for b_text in train_on:
        b = Layout.parse(b_text)
        cont = ActorShard(ARGS, HP, a, rank, seed=SEED, groups=groups)
        load_actor(cont, gen, b)
        train(cont, range(K, 2 * K))
        g = cont.state_dict_global()
        worst = max(((k, (g[k].double() - ref[k].double()).abs().max().item()) for k in ref if k != "rng"),
                    key=lambda x: x[1])
        out[f"train {b_text}"] = (diff({k: v for k, v in ref.items() if k != "rng"},
                                       {k: v for k, v in g.items() if k != "rng"}), worst)
        cont.free()
    return out


GROUPS = GroupCache()  # one per spawned rank process: groups of a layout are created once


def layouts_body(rank, world, root, cases):
    """`layouts_case` for each (A, Bs, train_on), each saving into its own directory under `root`."""
    return [layouts_case(rank, f"{root}/case{n}", *case) for n, case in enumerate(cases)]


def faults_body(rank, world, root, bad_root):
    """A = tp=2,dp=2. Crashes at every write phase, then good saves (pruning); a flipped byte; another model."""
    groups = GroupCache()
    a = Layout.parse("tp=2,dp=2")
    lead = a.devices[0]
    s = ActorShard(ARGS, HP, a, rank, seed=SEED, groups=groups)
    train(s, range(K))
    save_actor(s, root, CheckpointMeta(K, 32, K))
    dist.barrier()
    saved = s.local_tensors()
    train(s, range(K, K + 1))  # the live state moves on; the checkpoint must not
    out: dict = {"crash": []}
    for phase, victim in (("shard", None), ("shard", 1), ("manifest", lead), ("rename", lead), ("marker", lead)):
        def hook(p, phase=phase, victim=victim):
            if p == phase and victim in (None, rank):
                raise FaultInjected(f"crash at {p}")
        try:
            save_actor(s, root, CheckpointMeta(K + 1, 48, K + 1), fault=hook)
            res = "saved"
        except (FaultInjected, CheckpointError) as e:
            res = type(e).__name__
        dist.barrier()
        gen = latest(root)
        left = sorted(p.name for p in Path(root).iterdir())
        out["crash"].append((phase, victim, res, gen.name if gen else None, left))

    def full_disk(p):   # rank 1's write fails as a full disk fails it, half the file written
        if p == "shard" and rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:
        save_actor(s, root, CheckpointMeta(K + 1, 48, K + 1), fault=full_disk)
        out["full disk"] = None
    except CheckpointError as e:
        out["full disk"] = (type(e).__name__, str(e))
    dist.barrier()
    out["full disk left"] = sorted(p.name for p in Path(root).iterdir())
    probe = ActorShard(ARGS, HP, a, rank, seed=SEED, groups=groups)
    load_actor(probe, latest(root), a)
    out["after crash"] = diff(saved, probe.local_tensors())
    for step in (K + 1, K + 2):  # good saves clean up the leftovers and keep two generations
        save_actor(s, root, CheckpointMeta(step, 0, step))
        dist.barrier()
    out["gens"] = [(st, ok) for st, _, ok in generations(root)]
    out["left"] = sorted(p.name for p in Path(root).iterdir())
    try:
        save_actor(s, root, CheckpointMeta(K + 2, 0, 0))
        out["again"] = None
    except CheckpointError as e:
        out["again"] = (e.field, str(e))
    dist.barrier()

    # a flipped byte in one shard: latest skips it, a load names the file and changes nothing anywhere
    bad = Path(bad_root) / f"gen-{K}"
    if rank == 0:
        shutil.copytree(Path(root) / f"gen-{K + 1}", bad)
        f = bad / "shard-tp1-dp0.safetensors"
        raw = bytearray(f.read_bytes())
        raw[len(raw) - 7] ^= 0x40
        f.write_bytes(bytes(raw))
    dist.barrier()
    before = probe.local_tensors()
    digest = tree_digest(Path(bad_root))
    try:
        load_actor(probe, bad, a)
        out["corrupt"] = None
    except CheckpointError as e:
        out["corrupt"] = (e.field, str(e))
    out["corrupt unchanged"] = (diff(before, probe.local_tensors()), tree_digest(Path(bad_root)) == digest,
                                latest(bad_root))
    # another model's actor: the error names the field; its state and the files stay as they were
    other = ActorShard(OTHER, HP, a, rank, seed=SEED, groups=groups)
    before = other.local_tensors()
    digest = tree_digest(Path(root))
    try:
        load_actor(other, latest(root), a)
        out["other"] = None
    except CheckpointError as e:
        out["other"] = (e.field, e.exit_code, str(e))
    out["other unchanged"] = (diff(before, other.local_tensors()), tree_digest(Path(root)) == digest)
    return out


# ---- world runs (one per size, shared by the tests below) --------------------------------------------------------
B4 = ["tp=1,dp=4",                     # TP 2 -> 1, DP 2 -> 4
      "tp=2,dp=1,devices=2-3",         # DP 2 -> 1, shrink onto half the devices
      "tp=1,dp=3,devices=1-3",         # uneven DP, shifted devices
      "tp=4,dp=1"]                     # TP 2 -> 4
TRAIN4 = ["tp=2,dp=2", "tp=2,dp=1,devices=2-3", "tp=4,dp=1"]   # same layout, DP change, TP change
DISJOINT = ["tp=2,dp=1,devices=2-3", "tp=1,dp=2,devices=2-3"]   # from devices 0-1 to 2-3 (no shared device)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt4")
    cases = [("tp=2,dp=2", B4, TRAIN4), ("tp=2,dp=1,devices=0-1", DISJOINT, DISJOINT[1:])]
    return run_ranks(4, layouts_body, str(root), cases), root


@pytest.fixture(scope="module")
def faults4(tmp_path_factory):
    root, bad = tmp_path_factory.mktemp("ckptf"), tmp_path_factory.mktemp("ckptbad")
    return run_ranks(4, faults_body, str(root), str(bad)), root


def test_load_same_and_other_layouts_bitwise(world4):
    res = [r[0] for r in world4[0]]
    assert res[0]["gen"] == f"gen-{K}"
    for b_text in ["tp=2,dp=2"] + B4:
        bad = sorted({k for r in res for k in r[f"load {b_text}"]})
        assert not bad, f"load at {b_text} differs from the (resharded) original in {bad}"
        assert all(r[f"meta {b_text}"] == (K, 32, K, True) for r in res), b_text


def test_train_on_after_load(world4):
    res = [r[0] for r in world4[0]]
    for b_text in TRAIN4:
        bad, (key, worst) = res[0][f"train {b_text}"]
        if Layout.parse(b_text).tp == 2:  # same layout and DP change: bit-identical
            assert not bad, f"{b_text}: {bad[:6]} differ (worst {key}: {worst:.3g})"
        else:                             # TP change: fp32 round-off of the TP matmul split (docs/resharding.md)
            assert worst < 2e-5, f"{b_text}: {key} differs by {worst:.3g}"
        print(f"train on after load at {b_text}: bitwise={not bad}, max abs diff {worst:.3g} ({key})")


def test_disjoint_devices(world4):
    res = [r[1] for r in world4[0]]
    for b_text in DISJOINT:
        assert not any(r[f"load {b_text}"] for r in res), b_text
    _bad, (key, worst) = res[0][f"train {DISJOINT[1]}"]  # TP 2 -> 1: round-off only
    assert worst < 2e-5, (key, worst)


def test_a_full_disk_names_the_rank_and_leaves_no_partial_generation(faults4):
    res, _ = faults4
    kind, msg = res[1]["full disk"]
    assert kind == "CheckpointError" and "rank 1" in msg and "No space left on device" in msg
    kind, msg = res[0]["full disk"]
    assert kind == "PeerCheckpointError" and "rank(s) [1] failed" in msg
    assert not [n for n in res[0]["full disk left"] if n.startswith("tmp-")]   # no partial generation left


def test_crash_mid_write_keeps_previous_generation(faults4):
    res, _ = faults4
    for phase, victim, outcome, gen, left in res[0]["crash"]:
        assert outcome != "saved", phase
        assert gen == f"gen-{K}", (phase, victim, gen, left)
    assert [c[2] for c in res[1]["crash"]][:2] == ["FaultInjected", "FaultInjected"]  # rank 1: its own crash
    assert res[0]["crash"][1][2] == "PeerCheckpointError"   # rank 0 in the rank-1 crash: "rank(s) [1] failed"
    assert not any(r["after crash"] for r in res)
    assert res[0]["gens"] == [(K + 2, True), (K + 1, True)]        # keep_last=2, gen-K pruned
    assert res[0]["left"] == [f"gen-{K + 1}", f"gen-{K + 2}"]       # stale tmp and marker-less gen removed
    field, msg = res[0]["again"]
    assert field == "checkpoint.step" and "already holds a complete checkpoint" in msg


def test_flipped_byte_is_detected_and_changes_nothing(faults4):
    res, _ = faults4
    for r in res:
        field, _msg = r["corrupt"]
        assert field == "checkpoint"
        changed, files_same, newest = r["corrupt unchanged"]
        assert not changed and files_same and newest is None
    owner = res[1]["corrupt"][1]  # rank 1 = (t=1, d=0) reads the damaged file itself
    assert "shard-tp1-dp0.safetensors" in owner and "corrupted" in owner and "previous generation" in owner
    assert "another rank failed" in res[0]["corrupt"][1]


def test_other_model_is_a_clear_error_and_changes_nothing(faults4):
    res, _root = faults4
    for r in res:
        field, code, msg = r["other"]
        assert field == "model.intermediate_size" and code == 2 and "48" in msg and "40" in msg, msg
        changed, files_same = r["other unchanged"]
        assert not changed and files_same


# ---- pure: files left by the world run ----------------------------------------------------------------------
def test_manifest_contents(faults4):
    _, root = faults4
    gen = latest(root)
    m = verify(gen)
    assert m.meta == CheckpointMeta(K + 2, 0, K + 2) and m.layout == Layout.parse("tp=2,dp=2")
    assert m.optimizer_step == K + 1 and m.data_cursor == 5 * (K + 1)
    assert [(r.t, r.d) for r in m.shards] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert tuple(m.specs) == tuple(param_specs(ARGS)) and m.seed == SEED
    assert all(p.suffix in (".safetensors", ".json") or p.name == MARKER for p in gen.iterdir())


def test_damaged_generations_are_skipped(faults4, tmp_path):
    _, root = faults4
    work = tmp_path / "ck"
    shutil.copytree(root, work)
    newest, older = work / f"gen-{K + 2}", work / f"gen-{K + 1}"
    (newest / "manifest.json").write_text((newest / "manifest.json").read_text().replace('"seed": 3', '"seed": 4'))
    with pytest.raises(CheckpointError, match="COMPLETE marker"):
        read_manifest(newest)
    assert latest(work) == older
    (older / MARKER).unlink()  # a generation without its marker does not exist
    assert latest(work) is None
    with pytest.raises(CheckpointError, match="no COMPLETE"):
        read_manifest(older)
    (newest / "shard-tp0-dp1.safetensors").unlink()
    with pytest.raises(CheckpointError):
        verify(newest)


def test_check_model_names_the_field(faults4):
    _, root = faults4
    m = read_manifest(latest(root))
    check_model(m, ARGS, tuple(param_specs(ARGS)), "x")
    for field, other in (("model.hidden_size", replace(ARGS, hidden_size=32)),
                         ("model.vocab_size", replace(ARGS, vocab_size=29)),
                         ("model.tie_embeddings", replace(ARGS, tie_embeddings=True))):
        with pytest.raises(CheckpointError) as e:
            check_model(m, other, tuple(param_specs(other)), "x")
        assert e.value.field == field and isinstance(e.value, TidalError) and e.value.exit_code == 2


@pytest.mark.parametrize("a,b", [("tp=2,dp=2", "tp=1,dp=3,devices=1-3"), ("tp=1,dp=4", "tp=4,dp=1"),
                                 ("tp=4,dp=2", "tp=2,dp=3,devices=2-7"), ("tp=1,dp=1", "tp=2,dp=2")])
def test_each_rank_reads_exactly_what_it_holds(a, b):
    """Reads cover every element of the new rank's buffers exactly once: nobody reads more than it holds."""
    specs = tuple(param_specs(ARGS))
    old, new = Layout.parse(a), Layout.parse(b)
    for dst in new.devices:
        t, d = new.coord(dst)
        shape = ZeroShape.of(specs, new.tp, new.dp, t, d)
        moves = load_moves(old, new, specs, dst)
        got = {"param": 0, "optim": 0}
        for mv in moves:
            got[mv.what] += mv.numel
        assert got == {"param": shape.param_total, "optim": shape.opt_total}, (a, b, dst)


@pytest.mark.slow
def test_world8_layouts(tmp_path):
    res = [r[0] for r in run_ranks(8, layouts_body, str(tmp_path), [(
        "tp=2,dp=4", ["tp=4,dp=1,devices=4-7", "tp=1,dp=7,devices=1-7", "tp=2,dp=3,devices=2-7"],
        ["tp=2,dp=3,devices=2-7"])])]
    for b in ["tp=2,dp=4", "tp=4,dp=1,devices=4-7", "tp=1,dp=7,devices=1-7", "tp=2,dp=3,devices=2-7"]:
        assert not any(r[f"load {b}"] for r in res), b
    assert not res[0]["train tp=2,dp=3,devices=2-7"][0]


# ---- the pipeline: TrainingRun.checkpoint / open(resume_from=...) on real Ray workers -------------------------
def _run_cfg(out: Path, actor: str, rollout: str, inference: str, num_devices: int, **model):
    from tidal.core.config import build_config
    return build_config({
        "cluster": {"num_nodes": 1, "num_devices_per_node": num_devices, "auto_scheduler": False,
                    "component_placement": {"actor": actor, "rollout": rollout, "inference": inference}},
        "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 48,
                  **model},
        "warm_start": {"iters": 0}, "algorithm": {"group_size": 4, "n_minibatches": 2},
        "data": {"rollout_batch_size": 4, "eval_size": 8}, "run": {"num_steps": 3, "output_dir": str(out)},
        "reward": {"function": PARITY_REWARD}})   # the random model's groups are half rewarded: every iter trains


def test_resume_rejects_another_models_checkpoint_before_starting(faults4, tmp_path):
    from tidal.pipeline.run import TrainingRun
    _, root = faults4
    digest = tree_digest(root)
    run = TrainingRun(_run_cfg(tmp_path, "0", "1", "2", 3), tmp_path / "r")
    with pytest.raises(CheckpointError) as e:
        run.open(resume_from=root)
    assert e.value.field.startswith("model.") and e.value.exit_code == 2
    assert run.group is None and tree_digest(root) == digest   # no worker started, nothing written
    with pytest.raises(CheckpointError, match="no complete, verified checkpoint"):
        TrainingRun(_run_cfg(tmp_path, "0", "1", "2", 3), tmp_path / "r").open(resume_from=tmp_path)


@pytest.mark.slow
def test_pipeline_resume_equals_uninterrupted(tmp_path):
    """1 step, checkpoint, 1 step vs resume + 1 step: same placement and a DP change (actor 0 -> 0-1)."""
    from tidal.pipeline.run import TrainingRun
    ck = tmp_path / "ck"

    def run(cfg, resume=None, save=False):
        r = TrainingRun(cfg, tmp_path / f"run{len(list(tmp_path.iterdir()))}")
        try:
            r.open(resume_from=resume)
            first, start = r.next_step, start_weights(r)
            if save:
                r.step()
                r.checkpoint(ck)
            r.step()
            return first, r.pipe.version, r.pipe.data_pos, trained(r, start, final=r.pipe.global_weights())
        finally:
            r.close()

    _, v_a, pos_a, uninterrupted = run(_run_cfg(tmp_path / "o", "0", "1", "2", 3), save=True)
    assert [p.name for p in ck.iterdir()] == ["gen-1"]
    for cfg in (_run_cfg(tmp_path / "o", "0", "1", "2", 3), _run_cfg(tmp_path / "o", "0-1", "2", "3", 4)):
        first, v, pos, resumed = run(cfg, resume=ck)
        assert (first, v, pos) == (1, v_a, pos_a) == (1, 2, DataPosition(0, 8))
        assert_same_training(uninterrupted, resumed)
