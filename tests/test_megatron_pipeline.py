"""`actor.backend: megatron` in the pipeline: real device workers (Ray, gloo, CPU virtual devices) train a tiny
Qwen2-style Hugging Face checkpoint written by transformers, with the actor resharded through TP and DP changes at
fixed iters, and the run compared against the native backend, against its own static run and against a collocated
run on one device with every offload on.

What holds and why (the numbers are measured, the bounds carry margin):
- megatron vs native, same dynamic run: final weights within `MEGATRON_VS_NATIVE` (lr 1e-3). Both are fp32 on
  CPU, but GPTModel's kernels are not ours (unfused attention, its own RoPE and vocab-parallel cross entropy), so
  grads agree to fp32 round-off only, and Adam turns a round-off difference of a grad near zero into up to one
  step (lr) of difference in that weight.
- megatron dynamic vs megatron static: *not* bit for bit, unlike the native backend. Megatron's DDP sums each DP
  rank's micro-batch grads in its own buffer and reduce-scatters the partial sums, so the addition order depends on
  the DP size (the native actor adds every micro-batch's grad in index order, whatever the DP size), and a TP
  change reorders the matmul and softmax sums (as it does for the native actor). What holds: the same bound as
  megatron vs native. A reshard itself is exact (tests/test_megatron_backend.py: state bit-identical over 15 moves).
- the weight sync: inference's native engine, loaded with the weights the Megatron actor exported (the engines'
  names, unfused, padded vocab rows dropped), scores the step's groups within 1e-5 of the Megatron actor's own
  log-probs (two attention kernels in fp32).
- run checkpoints: a Megatron actor writes the native format (and, when its layout spans the world, the same state
  in megatron-core's format); loading it back changes no weight, and the native backend loads it to exactly the
  Megatron actor's weights.
- hand-overs: offload / onload of the optimizer state, grads and weights are exact (world 1, three iters); the
  export at TP 2 is exactly the weights the actor was built from, and a checkpoint written at TP 2 loads at DP 2
  as the in-memory reshard does (world 2).
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_gsm8k_files, make_hf_checkpoint
from safetensors.torch import load_file
from training_equality import PARITY_REWARD, Trained, assert_same_training, start_weights, trained

from scheduler.actions import ReshardActor
from scheduler.signals import ActorLayout
from tidal.core.config import build_config
from tidal.core.errors import ConfigError
from tidal.pipeline.checkpointing import resume
from tidal.pipeline.run import TrainingRun
from tidal.workers import roles

pytestmark = pytest.mark.usefixtures("shared_ray")

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core")
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed "
                                                              "(pip install -e '.[megatron]')")

#: 4 CPU devices: the actor on 0-1, one rollout instance, one scorer; one step of 8 groups of 4, 4 iters
BASE = {
    "run": {"num_steps": 1, "seed": 3},
    "cluster": {"num_devices_per_node": 4, "component_placement": {"actor": "0-1", "rollout": "2",
                                                                    "inference": "3"}},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 12, "max_running_requests": 8},
    "algorithm": {"group_size": 4, "n_minibatches": 4},
    "data": {"rollout_batch_size": 8, "eval_size": 8, "prompt_key": "question", "max_prompt_length": 20},
    # a random model never earns the task's reward, and equal rewards train nothing: half the samples are rewarded
    "reward": {"function": PARITY_REWARD},
    "warm_start": {"iters": 0},
}
#: every component on device 0, taking turns
COLLOCATED = {**BASE, "cluster": {"num_devices_per_node": 1, "component_placement": {"actor,rollout,inference": "0"}}}
#: max |w_a - w_b| over every weight after the run: measured 6.6e-7 (megatron vs native) and 1.8e-7 (megatron
#: dynamic vs static). The bound is 10% of one Adam step (lr = 1e-3): Adam normalizes each element's grad, so a
#: round-off difference in a grad near zero can move that weight by up to a step (module doc)
MEGATRON_VS_NATIVE = 1e-4


def scripted(state, sig, now):
    """A TP change, a DP shrink (device 1 leaves) and a DP grow (it comes back) at fixed iters (member-local: the
    scheduler made the groups of every layout the actor can grow to at start)."""
    if sig.trigger != "boundary" or not sig.actor.at_boundary:
        return []
    lay = sig.actor.layout
    want = {1: ActorLayout(2, 1, (0, 1)), 2: ActorLayout(1, 1, (0,)), 3: ActorLayout(1, 2, (0, 1))}.get(
        sig.actor.iters_done)
    return [ReshardActor("script", lay, want)] if want is not None and lay != want else []


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A Qwen2-style checkpoint (q/k/v biases) by transformers and GSM8K-format files: the runs' overrides."""
    root = tmp_path_factory.mktemp("megatron_pipeline")
    ckpt = make_hf_checkpoint(root / "ckpt", "qwen2")
    train, val = make_gsm8k_files(root / "data", n_train=32, n_val=8)
    return root, [f"model.path={ckpt}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]


def _open(root: Path, name: str, overrides: list[str], policy=None, base: dict = BASE) -> TrainingRun:
    cfg = build_config(base, [f"run.output_dir={root}", f"run.name={name}", *overrides])
    run = TrainingRun(cfg, root / name)
    run.policy = policy
    return run.open()


def _train(run: TrainingRun) -> Trained:
    start = start_weights(run)
    for _ in range(run.cfg.run.num_steps):
        run.step()
    run.finish()
    return trained(run, start)


def _actor_vs_inference(run: TrainingRun) -> float:
    """Max |log-prob| difference between the actor's own scoring and inference's (which holds the synced
    weights) over three of the last step's groups."""
    pipe = run.pipe
    groups = list(pipe.step_state.scored.values())[:3]
    rescored = pipe.group.call(pipe.placement.inference[0], roles.inference_score, groups=groups)
    actor = next(r for r in pipe.group.gather(pipe.group.submit_all(
        roles.actor_score, device_ids=pipe.placement.actor.devices, groups=groups)) if r is not None)
    return max(float((a - b).abs().max()) for g, mine in zip(rescored, actor) for a, b in zip(g.old_logprobs, mine))


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@needs_megatron
@pytest.mark.slow
def test_megatron_actor_in_a_dynamic_run(inputs):
    root, files = inputs
    # the Megatron actor, resharded tp1dp2 -> tp2dp1 -> tp1dp1@0 -> tp1dp2 in both steps
    run = _open(root, "megatron", ["actor.backend=megatron", "cluster.auto_scheduler=true", *files], scripted)
    try:
        meg = _train(run)
        events = run.pipe.cluster.events
        reshards = [(e["from_layout"], e["to_layout"]) for e in events if e["kind"] == "reshard"]
        assert reshards == [("tp=1,dp=2,devices=0-1", "tp=2,dp=1,devices=0-1"),
                            ("tp=2,dp=1,devices=0-1", "tp=1,dp=1,devices=0"),
                            ("tp=1,dp=1,devices=0", "tp=1,dp=2,devices=0-1")], reshards
        # the Megatron actor plans its moves on the ranks (no driver-made program: `program_inputs` is None)
        assert not any(e["prepared"] for e in events if e["kind"] == "reshard")
        assert {(e["tp"], e["dp"]) for e in events if e["kind"] == "iter"} == {(1, 2), (2, 1), (1, 1)}
        assert _actor_vs_inference(run) < 1e-5
        ckpt = run.checkpoint(root / "ckpt-megatron")
        resume(run.pipe, ckpt)   # the native format, read back into the Megatron actor
        assert _max_diff(run.pipe.global_weights(), meg.final) == 0.0
    finally:
        run.close()
    # fp32 on CPU: each rank's master range equals its params there, and Adam's moments are carried
    for f in sorted(ckpt.glob("shard-*.safetensors")):
        shard = load_file(str(f))
        assert torch.equal(shard["param"], shard["master"]), f
        assert shard["exp_avg"].abs().max() > 0 and int(shard["scalars"][0]) == 4, f

    run = _open(root, "native", ["cluster.auto_scheduler=true", *files], scripted)
    try:
        native = _train(run)
        moves = [e for e in run.pipe.cluster.events if e["kind"] == "reshard"]
        assert len(moves) == 3 and all(e["prepared"] for e in moves)   # the native actor runs the driver's programs
        resume(run.pipe, ckpt)   # the Megatron actor's checkpoint in the native actor: the same weights
        assert _max_diff(run.pipe.global_weights(), meg.final) == 0.0
    finally:
        run.close()
    run = _open(root, "megatron-static", ["actor.backend=megatron", "actor.megatron_transformer_engine=false",
                                          *files])
    try:
        # the key reaches the workers' backends (RunSpec.backend_options)
        assert run.pipe.actor_build == "megatron, local (actor.megatron_transformer_engine: false) layer spec"
        static = _train(run)
    finally:
        run.close()
    # collocated on one device with every offload on: the engines load the copy the actor kept at the step end
    # (`gather_replica`), never through the driver, and the actor's state waits in host memory while they run
    offloads = [f"actor.offload_{k}=true" for k in ("optimizer", "grad", "weight")]
    run = _open(root, "megatron-collocated", ["actor.backend=megatron", *offloads, *files], base=COLLOCATED)
    try:
        collocated = _train(run)
        events = run.pipe.cluster.events
        syncs = [e for e in events if e["kind"] == "weight_sync"]
        assert [(e["local"], e["remote"]) for e in syncs] == [([0], [])], syncs
        hand = [(e["direction"], e["bytes"], e["actor_resident"]) for e in events if e["kind"] == "handover"]
        assert [d for d, _, _ in hand] == ["to_generation", "to_training", "to_generation"], hand
        assert all(moved > 0 for _, moved, _ in hand) and hand[0][2] == hand[-1][2] == 0, hand
        back = run.pipe.group.call(0, roles.actor_onload)   # the engines hold the weights; the actor's come back
        assert back.bytes == hand[0][1] and back.actor_resident > 0, back
        assert _actor_vs_inference(run) < 1e-5
    finally:
        run.close()
    d_native, d_static, d_coll = (_max_diff(a.final, b.final) for a, b in ((meg, native), (meg, static),
                                                                           (collocated, static)))
    print(f"megatron vs native {d_native:.2e}, megatron dynamic vs static {d_static:.2e}, collocated (tp1dp1) vs "
          f"static (tp1dp2) {d_coll:.2e}")
    assert d_native > 0   # two engines' kernels: equal only to round-off
    for a, b in ((meg, native), (meg, static), (collocated, static)):
        assert_same_training(a, b, atol=MEGATRON_VS_NATIVE)


def test_training_backend_is_rlinf_s_name_for_backend():
    assert build_config({}).actor.backend == "native"
    assert build_config({"actor": {"training_backend": "megatron"}}).actor.backend == "megatron"
    assert build_config({"actor": {"backend": "megatron", "training_backend": "megatron"}}).actor.backend == "megatron"
    with pytest.raises(ConfigError) as err:
        build_config({"actor": {"training_backend": "fsdp"}})
    assert err.value.field == "actor.training_backend" and "actor.backend: native" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_config({"actor": {"training_backend": "deepspeed"}})
    assert err.value.field == "actor.training_backend" and "native or megatron" in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_config({"actor": {"backend": "native", "training_backend": "megatron"}})
    assert err.value.field == "actor.training_backend" and "set only one" in err.value.fix


def test_megatron_refuses_what_it_cannot_do_at_config_time():
    for key, value in (("activation_checkpointing", True), ("on_nonfinite", "skip")):
        with pytest.raises(ConfigError) as err:
            build_config({"actor": {"backend": "megatron", key: value}})
        assert err.value.field == f"actor.{key}" and "actor.backend: native" in err.value.fix, err.value
        assert build_config({"actor": {key: value}}).actor.backend == "native"   # the native actor does both


def _offload_round_trip(rank, world):
    """World 1: two Megatron actors train three iters on the same data; one hands every part of its state to
    host memory and takes it back between iters (and exports its weights while away)."""
    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.model import ModelArgs, init_global_weights
    from tidal.engine.optim import OptimConfig

    args = ModelArgs(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     max_seq_len=32, qkv_bias=True)
    hp = OptimConfig(lr=1e-3, warmup_iters=0, total_iters=10)
    w = init_global_weights(args, 3)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, args.vocab_size, (2, 12), generator=g) for _ in range(2)]
    ref, x = (make_backend("megatron", args, hp, Layout(1, 1, (0,)), 0, weights=w) for _ in range(2))
    out = []
    for _ in range(3):
        for a in (ref, x):
            a.train_iter(SharedQueue(mbs), nll_loss, 44)
        held, replica = x.held_bytes(), x.gather_replica()
        moved = x.offload(optimizer=True, grad=True, weight=True)
        away = x.resident_bytes(), x.held_bytes(), x.gather_replica()
        back = x.onload()
        out.append((moved, back, held, *away[:2], all(torch.equal(replica[k], away[2][k]) for k in replica)))
    a, b = ref.state_dict_global(), x.state_dict_global()
    return out, all(torch.equal(a[k], b[k]) for k in a)


def _exports_at_tp2(rank, world):
    """World 2, tp2dp1: what each rank exports for the engines, and the replica it keeps."""
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.model import ModelArgs, init_global_weights
    from tidal.engine.optim import OptimConfig

    # vocab 51: our TP split gives 25 / 26 rows, Megatron's padded one 64 / 64; q/k/v biases and q/k norms fused
    args = ModelArgs(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     max_seq_len=32, qkv_bias=True, qk_norm=True, head_dim=24)
    w = init_global_weights(args, 3)
    g = torch.Generator().manual_seed(1)
    w = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in w.items()}   # no two tensors alike
    meg = make_backend("megatron", args, OptimConfig(), Layout(2, 1, (0, 1)), rank, weights=w)
    exported, replica = meg.export_weights(), meg.gather_replica()
    return exported.tp, exported.t, exported.tensors, replica, w


@needs_megatron
def test_megatron_exports_the_engines_weights_at_tp2():
    """The engines get our names and TP split (rollout_shard takes them as from a native actor), exactly the
    weights the actor was built from: fused QKV and [gate; up] undone, the padded vocab rows dropped."""
    from tidal.engine.generation.weights import rollout_shard
    from tidal.engine.model import ModelArgs
    from tidal.engine.testing import run_ranks
    out = run_ranks(2, _exports_at_tp2)
    w = out[0][4]
    args = ModelArgs(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     max_seq_len=32, qkv_bias=True, qk_norm=True, head_dim=24)
    assert [(tp, t) for tp, t, *_ in out] == [(2, 0), (2, 1)]
    merged = rollout_shard(args, [out[0][2], out[1][2]], 1, 0)
    for got in (merged, out[0][3], out[1][3]):
        assert set(got) == set(w) and all(torch.equal(got[k], w[k]) for k in w)


def _checkpoint_at_tp2(rank, world, root):
    """World 2: an actor at tp2dp1 trains two iters and writes a run checkpoint; a fresh actor (other weights)
    loads it at tp1dp2, and the first reshards to tp1dp2 in memory: their global states."""
    import torch.distributed as dist

    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.checkpoint import CheckpointMeta, begin, commit
    from tidal.engine.layout import Layout
    from tidal.engine.model import ModelArgs
    from tidal.engine.optim import OptimConfig

    args = ModelArgs(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     max_seq_len=32, qkv_bias=True)
    hp = OptimConfig(lr=1e-3, warmup_iters=0, total_iters=10)
    g = torch.Generator().manual_seed(0)
    mbs = [torch.randint(0, args.vocab_size, (2, 12), generator=g) for _ in range(2)]
    a, b = Layout(2, 1, (0, 1)), Layout(1, 2, (0, 1))
    x = make_backend("megatron", args, hp, a, rank, seed=1)
    y = make_backend("megatron", args, hp, a, rank, seed=2, groups=x.groups)
    for _ in range(2):
        x.train_iter(SharedQueue(mbs), nll_loss, 44)
    if rank == 0:
        begin(root, 2)
    dist.barrier()
    x.save_checkpoint(f"{root}/tmp-2", CheckpointMeta(step=2, data_pos=0, policy_version=2))
    dist.barrier()
    if rank == 0:
        commit(root, 2)
    dist.barrier()
    loaded = y.load_checkpoint(f"{root}/gen-2", b)   # world-wide layouts: the megatron-format copy is read
    x.reshard(b)
    sx, sy = x.state_dict_global(), y.state_dict_global()
    same = all(torch.equal(sx[k], sy[k]) for k in sx)
    if rank == 0:   # without the copy: the native shards
        os.rename(f"{root}/gen-2/megatron", f"{root}/megatron-gen-2")
    dist.barrier()
    native = y.load_checkpoint(f"{root}/gen-2", b)
    sn = y.state_dict_global()
    return (loaded, native, y.layout == b, same and all(torch.equal(sx[k], sn[k]) for k in sx),
            float(sx["exp_avg/output_layer.weight"].abs().max()))


@needs_megatron
def test_megatron_run_checkpoint_at_tp2_loads_at_another_layout(tmp_path):
    """A run checkpoint carries the whole Megatron state twice: the native shards, and (the layout spans the world)
    megatron-core's format with the distributed optimizer's state. Written at tp2dp1, read at tp1dp2 from either
    (megatron-core's load or the native loader reshard on load), it equals the in-memory reshard of the same state
    bit for bit, Adam moments and step too."""
    from tidal.engine.testing import run_ranks
    for loaded, native, moved, same, moments in run_ranks(2, _checkpoint_at_tp2, str(tmp_path), daemon=False):
        assert (loaded.source, loaded.optimizer, native.source) == ("megatron", "checkpoint", "native"), loaded
        assert loaded.in_layout and loaded.optimizer_step == native.optimizer_step == 2, (loaded, native)
        assert moved and same and moments > 0


@needs_megatron
def test_megatron_offload_and_onload_are_exact():
    from tidal.engine.testing import run_ranks
    rounds, same = run_ranks(1, _offload_round_trip)[0]
    assert same   # params, fp32 main params, Adam moments, step: bit for bit with the actor that never left
    for moved, back, held, resident, held_away, export_same in rounds:
        assert moved == back == held > 0 and resident == 0 and held_away == held and export_same


def test_rlinf_training_backend_converts():
    from tidal.convert.rlinf import convert
    conv = convert({"actor": {"training_backend": "megatron"}})
    assert conv.config["actor"]["backend"] == "megatron"
    assert ("actor.training_backend", "actor.backend") in {(c.key, c.target) for c in conv.carried}
    conv = convert({"actor": {"training_backend": "fsdp"}})
    assert "backend" not in conv.config.get("actor", {})
    assert any(d.key == "actor.training_backend" and "actor.backend: native" in d.reason for d in conv.dropped)
    with pytest.raises(ConfigError) as err:
        convert({"actor": {"training_backend": "deepspeed"}})
    assert "actor.training_backend" in err.value.field


def test_megatron_without_megatron_core_fails_preflight(tmp_path):
    """A `megatron` package without `core` shadows the installed one (what a broken install looks like): the
    preflight `tidal train` and `tidal validate` run stops with actor.backend and the install command, before any
    worker would start."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    code = ("from tidal.core.config import build_config\n"
            "from tidal.pipeline.preflight import preflight\n"
            "preflight(build_config({'actor': {'backend': 'megatron'}}), tracked=False)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ConfigError: actor.backend" in out.stderr, out.stderr
    assert "pip install -e '.[megatron]'" in out.stderr, out.stderr


def test_megatron_transformer_engine_switch_at_config_time():
    """`actor.megatron_transformer_engine`: auto (default) and false always validate; true without Transformer
    Engine is refused naming the key and the fix (TE is not installed on the machines these tests run on)."""
    assert build_config({}).actor.megatron_transformer_engine == "auto"
    for value in ("auto", False):
        cfg = build_config({"actor": {"backend": "megatron", "megatron_transformer_engine": value}})
        assert cfg.actor.megatron_transformer_engine == value
    # the native actor ignores it
    assert build_config({"actor": {"megatron_transformer_engine": True}}).actor.backend == "native"
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(ConfigError) as err:
            build_config({"actor": {"backend": "megatron", "megatron_transformer_engine": True}})
        assert err.value.field == "actor.megatron_transformer_engine"
        assert "transformer_engine" in err.value.fix and "auto" in err.value.fix, err.value


def test_megatron_layer_spec_choice():
    """The pure choice (both sides of `importable`), the TE names' mapping, and the build record of a real actor
    here (no TE: the local spec, reported with the reason)."""
    from tidal.engine.backends.megatron_map import LayerSpecChoice, choose_layer_spec, local_param_name

    assert choose_layer_spec("auto", True) == LayerSpecChoice(True, "auto: transformer_engine is importable")
    assert choose_layer_spec("auto", False) == LayerSpecChoice(False, "auto: transformer_engine is not importable")
    assert choose_layer_spec(True, True).transformer_engine and not choose_layer_spec(False, True).transformer_engine
    assert not choose_layer_spec(False, False).transformer_engine
    with pytest.raises(ConfigError) as err:
        choose_layer_spec(True, False)
    assert err.value.field == "actor.megatron_transformer_engine" and "auto" in err.value.fix
    te = "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight"
    assert local_param_name(te, True) == "decoder.layers.3.input_layernorm.weight"
    assert local_param_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", True) == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert local_param_name(te, False) == te
    assert local_param_name("decoder.layers.0.mlp.linear_fc1.weight", True) == "decoder.layers.0.mlp.linear_fc1.weight"


def _layer_spec_report(rank, world):
    from tidal.core.errors import ConfigError
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.model import ModelArgs
    from tidal.engine.optim import OptimConfig

    args = ModelArgs(vocab_size=51, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                     max_seq_len=32)
    hp, lay = OptimConfig(lr=1e-3), Layout(1, 1, (0,))
    auto = make_backend("megatron", args, hp, lay, 0).layer_spec
    off = make_backend("megatron", args, hp, lay, 0, transformer_engine=False).layer_spec
    try:
        make_backend("megatron", args, hp, lay, 0, transformer_engine=True)
        refused = ""
    except ConfigError as e:
        refused = e.field
    return str(auto), str(off), refused


@needs_megatron
def test_megatron_actor_reports_its_layer_spec():
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed: this checks the report where it is not")
    from tidal.engine.testing import run_ranks
    auto, off, refused = run_ranks(1, _layer_spec_report)[0]
    assert auto == "local (auto: transformer_engine is not importable)"
    assert off == "local (actor.megatron_transformer_engine: false)"
    assert refused == "actor.megatron_transformer_engine"
