"""The memory plan (tidal/pipeline/memory_plan.py): its bytes against hand-computed ones for a small model, the
phases of shared devices, TP sharding, and `tidal validate` refusing a model no device can hold."""

from pathlib import Path

import pytest
from hostile import Case, assert_refused, run_cases

from tidal.core.config import build_config, load_config
from tidal.core.errors import ConfigError
from tidal.engine.model import ModelArgs
from tidal.pipeline.memory_plan import (
    CPU_DRIVER_BYTES,
    CPU_WORKER_BYTES,
    CUDA_CONTEXT_BYTES,
    Capacity,
    GiB,
    MemoryInputs,
    actor_bytes,
    check_memory,
    memory_plan,
    plan_for,
)

# 920 parameters: embed 16x8, q/k/v/o 8x8 each, two norms of 8, gate/up/down 16x8 each, final norm 8, lm_head 16x8
ARGS = ModelArgs(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=16,
                 max_seq_len=32)
P = 128 + 4 * 64 + 2 * 8 + 3 * 128 + 8 + 128
BIG = 1 << 50   # a capacity nothing reaches


def inputs(placement: dict, kind: str = "cpu", **actor) -> MemoryInputs:
    cfg = build_config({"cluster": {"num_devices_per_node": 4, "component_placement": placement},
                        "model": {"max_seq_len": 32}, "actor": actor})
    return MemoryInputs.of(cfg, ARGS, kind)   # type: ignore[arg-type]


def test_the_small_model_has_the_hand_counted_parameters():
    assert ARGS.num_params() == P == 920


def test_actor_state_is_exact_for_zero1_over_two_dp_ranks():
    """fp32 on CPU: weights 4P replicated, masters 4P/2 and Adam 8P/2 owned, the grad buffer 4P (no fp32
    accumulator at c = 4); every parameter's numel is even, so each DP rank owns exactly half."""
    m = inputs({"actor": "0-1", "rollout": 2, "inference": 3})
    for d in (0, 1):
        a = actor_bytes(m, dp=2, t=0, d=d)
        assert (a.weights, a.masters, a.optimizer, a.grad_buffer, a.grad_accumulator) == \
            (4 * P, 4 * P // 2, 8 * P // 2, 4 * P, 0)


def test_bf16_on_cuda_keeps_a_bf16_copy_and_an_fp32_accumulator():
    m = inputs({"actor": "0-1", "rollout": 2, "inference": 3}, kind="cuda")
    a = actor_bytes(m, dp=2, t=0, d=0)
    assert (a.weights, a.masters, a.optimizer, a.grad_buffer, a.grad_accumulator) == \
        (2 * P, 4 * P // 2, 8 * P // 2, 2 * P, 4 * P)


def test_tp_splits_the_sharded_parameters_and_replicates_the_norms():
    """TP 2, rank 0: half the vocab rows of embed and lm_head (64 each), half of q/k/v's rows and o's columns
    (32 each), half of gate/up/down (64 each), the three norms whole (8 each)."""
    m = inputs({"actor": "0-1", "rollout": 2, "inference": 3}, tensor_parallel_size=2)
    local = 64 + 4 * 32 + 2 * 8 + 3 * 64 + 8 + 64
    a = actor_bytes(m, dp=1, t=0, d=0)
    assert (a.weights, a.masters, a.optimizer) == (4 * local, 4 * local, 8 * local)


def test_disjoint_devices_hold_their_own_component_only():
    m = inputs({"actor": "0-1", "rollout": 2, "inference": 3})
    plan = memory_plan(m, [BIG] * 4, BIG)
    rollout, scorer = plan.devices[2].parts, plan.devices[3].parts
    assert rollout["rollout weights"] == scorer["inference weights"] == 4 * P
    # CPU KV: 64 requests x 2 blocks of 16 positions + the null block, K and V, 1 layer x 2 heads x 4 dims, fp32
    assert rollout["rollout kv"] == (64 * 2 + 1) * 2 * 1 * 2 * 16 * 4 * 4
    assert not any(k.startswith(("rollout", "inference")) for k in plan.devices[0].parts)
    assert all(d.parts["runtime"] == CPU_WORKER_BYTES for d in plan.devices)
    assert plan.driver_bytes == CPU_DRIVER_BYTES + 4 * P
    assert plan.total == sum(d.total for d in plan.devices) + plan.driver_bytes


def test_a_shared_device_counts_its_worst_phase_and_offload_frees_the_actor_on_cuda():
    """Collocated on CUDA: generating, the device holds the engine (gpu_memory_utilization of it) and the kept
    replica beside what the actor leaves; with every offload key only the engine and the replica."""
    cap = 10_000_000
    place = {"actor,rollout,inference": "0-3"}
    kept = memory_plan(inputs(place, kind="cuda"), [cap] * 4)
    off = memory_plan(inputs(place, kind="cuda", offload_optimizer=True, offload_grad=True, offload_weight=True),
                      [cap] * 4)
    gen = off.devices[0].parts
    assert gen["rollout weights"] + gen["rollout kv"] == cap // 2   # gpu_memory_utilization 0.5
    assert gen["kept copy"] == 2 * P and gen["runtime"] == CUDA_CONTEXT_BYTES
    assert not any(k.startswith("actor") for k in gen)
    assert kept.devices[0].parts["actor optimizer"] == 8 * P // 4
    assert kept.devices[0].total > off.devices[0].total


def test_a_device_too_small_is_refused_naming_the_key_that_fits_first():
    place = {"actor,rollout,inference": "0-3"}
    m = inputs(place, kind="cuda")
    # generating, a device holds A + gpu_memory_utilization (0.5) x its capacity C: it fits from C = 2 A on
    probe = 1 << 32
    a = memory_plan(m, [probe] * 4).devices[0].total - probe // 2
    cap = 2 * a - 2   # just too small for TP 1; TP 2's smaller actor state fits
    cfg = build_config({"cluster": {"num_devices_per_node": 4, "component_placement": place},
                        "model": {"max_seq_len": 32}})
    with pytest.raises(ConfigError) as err:
        check_memory(cfg, ARGS, "cuda", Capacity([cap] * 4))
    e = err.value
    assert e.field == "actor.tensor_parallel_size"   # TP 2 halves the actor's state: fits
    assert e.problem.startswith("device 0 would hold 1.0 GiB (rollout kv 0.5, runtime 0.5)") and "and has" in e.problem
    assert "actor.offload_optimizer" in e.fix and "rollout.gpu_memory_utilization" in e.fix


def test_the_repository_experiments_fit_this_machine():
    """Every experiments/*.yaml that is a run config, with the warm-started model their model.path names
    (Tidal's own model of experiments/warmstart_addition.yaml), fits on CPU devices."""
    warm = load_config("experiments/warmstart_addition.yaml")
    args = ModelArgs.from_config(warm.model, 16)
    for path in sorted(Path("experiments").glob("*.yaml")):
        if path.name.startswith("sweep_"):   # sweep specs, not run configs
            continue
        plan = plan_for(load_config(path), args, "cpu")
        assert plan.fits, f"{path}: {plan.problem()}"
        assert plan.total < 4 * GiB, (path, plan.summary())


HUGE = ["cluster.num_devices_per_node=2", "cluster.component_placement={actor: 0, 'rollout,inference': 1}",
        "model.hidden_size=4096", "model.num_layers=32", "model.num_heads=32", "model.num_kv_heads=8",
        "model.intermediate_size=14336"]


def test_validate_refuses_a_model_no_cpu_run_can_hold_and_passes_the_default(tmp_path, capsys):
    """A 7-billion-parameter model on two CPU devices: the actor's fp32 state alone outgrows any CI machine, so
    `tidal validate` refuses it (exit 2, one line naming the model's key) before a worker starts. The default
    config passes and prints the plan's line."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run:\n  num_steps: 1\n")
    out = [f"run.output_dir={tmp_path / 'out'}"]
    cases = [Case("7B on two CPU devices", ["validate", str(cfg), *HUGE, *out, "--no-track"],
                  ["model.hidden_size", "GiB", "actor weights"], leftovers=[str(tmp_path / "out")])]
    assert_refused(cases, run_cases(cases, tmp_path))
    from tidal.cli.main import main
    assert main(["validate", str(cfg), "--no-track"]) == 0
    said = capsys.readouterr().out
    assert "memory: 8 CPU devices and the driver hold at most" in said
