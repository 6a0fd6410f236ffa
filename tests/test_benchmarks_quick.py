"""Every benchmark with a `--quick` mode runs on this CPU machine and writes the record it promises.

Each benchmark runs as a user runs it (`python benchmarks/<name>.py ... --json PATH`, from the repository root, in a
process of its own with its own Ray where it starts one) and its JSON is checked for the figures its docstring
names, with values that only a real run gives (seconds > 0, exact reshards, equal final weights).

Sizes: `--quick` where it takes seconds; `--smoke` (the same code path at toy sizes, each benchmark's `--help`)
where `--quick` is the mode of committed or cited results and takes minutes; a plain `--quick` narrowed by the
benchmark's own flags (fewer variants, fewer steps) where those flags exist. The runs that start Ray and a worker
per device are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(name: str, args: list[str], tmp_path: Path, timeout_s: float) -> dict:
    """Run `benchmarks/<name>.py` with `args`, assert it exits 0 and return its JSON. The benchmark runs in a
    session of its own, so a timeout kills it together with the Ray processes it started."""
    out = tmp_path / f"{name}.json"
    log = tmp_path / f"{name}.log"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "w") as f:   # the child holds its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, f"benchmarks/{name}.py", *args, "--json", str(out)], cwd=REPO,
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"benchmarks/{name}.py {' '.join(args)} ran past {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    assert rc == 0, f"benchmarks/{name}.py {' '.join(args)} exited {rc}:\n{log.read_text()[-3000:]}"
    return json.loads(out.read_text())


def _finite_positive(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def check_train_throughput(r: dict) -> None:
    assert r["name"] == "train_throughput" and r["best"] == "4x4"   # --quick: one setting, 4 x 4 sequences
    assert r["num_params"] > r["matmul_params"] > 0
    assert _finite_positive(r["tokens_per_s"]) and _finite_positive(r["iter_seconds"])
    assert r["tokens_per_iter"] == 4 * 4 * r["seq_len"]
    (row,) = r["configs"]
    assert len(row["iter_seconds_all"]) == r["iters"]
    assert len(row["losses"]) == r["warmup"] + r["iters"] and all(math.isfinite(x) for x in row["losses"])


def check_rollout(r: dict) -> None:
    assert r["name"] == "rollout" and r["device"] == "cpu"
    assert _finite_positive(r["copy_bandwidth_GBps"]) and r["weight_bytes"] > 0
    (row,) = r["throughput"]
    assert row["decode_steps"] == r["new_tokens"] - 1   # the prefill samples the first token
    assert row["response_tokens"] == r["batch"] * r["new_tokens"]
    assert _finite_positive(row["native_tokens_per_s"]) and _finite_positive(row["ms_per_decode_step"])
    if row.get("hf_tokens_per_s") is not None:   # transformers installed: the weight mapping agrees in fp32
        assert row["hf_first_token_agreement"] == 1.0
    assert [m["context_tokens"] for m in r["migration"]] == [512, 2048, 4096]
    for m in r["migration"]:
        assert _finite_positive(m["kv_move_s"]) and _finite_positive(m["reprefill_s"])


def check_hf_parity(r: dict) -> None:
    assert r["name"] == "hf_parity" and r["device"] == "cpu" and r["architecture"] == "Qwen2ForCausalLM"
    assert r["num_params"] > 0 and r["files"]
    fp32, bf16 = r["fp32"], r["bf16"]
    assert fp32["logprob_ours_vs_transformers"]["max"] < 1e-4   # the same model in the same dtype
    assert fp32["greedy_equal"] and fp32["greedy_first_difference"] is None
    assert 0 < bf16["logprob_ours_vs_fp32_transformers"]["max"] < 0.1   # bf16 rounding, not another model


def check_reshard(r: dict) -> None:
    assert r["name"] == "reshard" and r["shape"] == "smoke"
    assert r["model"]["rope_scaling"]["rope_type"] == "default"   # nested config values as plain JSON
    (case,) = r["cases"]
    assert case["world"] == 4 and case["exact"]
    assert case["bytes_moved"] > 0 and case["state_bytes"] >= case["bytes_moved"]
    for key in ("seconds", "gbps", "raw_seconds", "transport_ratio", "dcp_seconds", "dcp_speedup"):
        assert _finite_positive(case[key]), (key, case[key])
    assert set(case["phase_seconds"]) >= {"plan", "transfer", "commit"}


def check_collocated(r: dict) -> None:
    assert r["name"] == "collocated" and r["same_final_weights"]
    assert r["every_iter_trained"] and r["config"]["reward"] == "parity"   # equal weights of runs that trained
    assert r["config"]["mfu_reference"] == {"chip": "cpu", "datasheet_tflops": None, "measured_gemm_tflops": None}
    v = r["variants"]["all"]
    assert v["offload"] == {"offload_optimizer": True, "offload_grad": True, "offload_weight": True}
    assert _finite_positive(v["step_s"]) and _finite_positive(v["actor_iter_tokens_per_s"])
    assert len(v["steps"]) == 2
    assert v["final_weights_sha"]
    step = v["steps"][1]
    assert step["offload_bytes"] > 0 and step["onload_bytes"] > 0   # the actor's state left and came back
    assert step["iters"] and all(_finite_positive(i["tokens_per_s"]) for i in step["iters"])
    assert set(step["phase_seconds"]) >= {"rollout", "inference", "actor"}


def check_e2e(r: dict) -> None:
    assert r["name"] == "e2e" and r["config"]["smoke"]
    assert set(r["runs"]) == {"static", "tidal"}
    for run in r["runs"].values():
        assert len(run["steps"]) == 2 and all(_finite_positive(s["seconds"]) for s in run["steps"])
        assert run["failed_actions"] == 0
        assert run["final_weights_sha"]
        (row,) = run["from_run"]["steps"]   # step 1 predicted from its own lengths (step 0 is the warm-up)
        assert row["step"] == 1 and all(_finite_positive(x) for x in row["predicted"].values())
    assert _finite_positive(r["static_step_s"]) and _finite_positive(r["tidal_step_s"])
    assert r["speedup_vs_static"] == pytest.approx(r["static_step_s"] / r["tidal_step_s"])
    assert _finite_positive(r["paired_speedup_vs_static"]["median"])
    assert all(_finite_positive(p["before"]) for p in r["core_speed"])
    assert set(r["simulator"]) == {"rlinf_example_8", "devices_1024", "cpu_e2e_workload"}
    for sim in r["simulator"].values():
        assert all(_finite_positive(p["mean_step_s"]) for p in sim["policies"].values())


def check_faults(r: dict) -> None:
    assert r["name"] == "faults" and r["config"]["smoke"]
    k, every = r["config"]["kill_step"], r["config"]["checkpoint_every"]
    assert [s["step"] for s in r["clean"]["steps"]] == list(range(k + 2))
    assert [s["step"] for s in r["resume"]["steps"]] == list(range(every, k + 1))
    assert set(r["cases"]) == {"rollout", "actor"}
    for which, case in r["cases"].items():
        assert case["same_final_weights"], which   # recovered runs end with the clean run's weights
        rec, back = case["recovery"], case["stop_and_resume"]
        assert _finite_positive(rec["kill_to_step_end_s"]) and _finite_positive(back["kill_to_step_end_s"])
        assert back["steps_redone"] == k - every and back["tokens_redone"] > 0
        assert _finite_positive(case["recovery_within_steps"])
    assert r["cases"]["actor"]["recovery"]["restarted_from"]
    assert r["cases"]["rollout"]["recovery"]["groups_redone"]


def check_scheduling(r: dict) -> None:
    assert r["name"] == "scheduler"
    t = r["table"]
    assert {(row["workload"], row["model"], row["devices"]) for row in t["rows"]} == {
        (w, m, 8) for w in ("gsm8k", "math", "longtail") for m in ("1.5b", "7b")}
    for row in t["rows"]:
        assert set(row["arms"]) == {"collocated", "hybrid", "static", "rlinf", "tidal"}
        assert all(_finite_positive(a["step_s"]) for a in row["arms"].values())
        assert row["tidal_vs_best_baseline"] >= 1.0 - 1e-9   # tidal never loses to a baseline at its best
    assert t["min_tidal_vs_best_baseline"] == min(row["tidal_vs_best_baseline"] for row in t["rows"])


def check_transfer(r: dict) -> None:
    assert r["name"] == "transfer" and r["device"] == "cpu" and r["route"] == "p2p"
    assert r["commit"] and r["machine"] and r["command"].startswith("python benchmarks/transfer.py")
    assert r["model"]["name"] == "cpu" and _finite_positive(r["d2d_copy_gbps"])
    assert [row["context_tokens"] for row in r["kv"]] == [256, 1024]
    for row in r["kv"]:
        assert row["exact"]   # every round's moved blocks equal the source's bit for bit
        assert row["blocks"] == -(-row["context_tokens"] // row["block_size"])
        assert row["kv_bytes"] > 0 and row["ipc_open_s"] is None and row["ipc_copy_s"] is None
        for key in ("kv_move_s", "reprefill_s", "ratio", "gbps", "copy_gbps", "bandwidth_ratio"):
            assert _finite_positive(row[key]), (key, row[key])
        assert row["ratio"] == pytest.approx(row["kv_move_s"] / row["reprefill_s"])
        assert row["bandwidth_ratio"] == pytest.approx(row["copy_gbps"] / r["d2d_copy_gbps"])
    w = r["weight_sync"]
    assert w["exact"] and w["weight_bytes"] > 0 and w["num_tensors"] > 0 and w["buckets"] >= 1
    for key in ("weight_sync_s", "weight_gbps", "pack_s"):
        assert _finite_positive(w[key]), (key, w[key])
    assert set(r["goals"]) == {"kv_ratio_max", "bandwidth_ratio_min", "weight_sync_s_max"}
    assert r["meets"] == {"ratio": all(row["ratio"] <= r["goals"]["kv_ratio_max"] for row in r["kv"]),
                          "bandwidth_ratio": all(row["bandwidth_ratio"] >= r["goals"]["bandwidth_ratio_min"]
                                                 for row in r["kv"]),
                          "weight_sync_s": w["weight_sync_s"] <= r["goals"]["weight_sync_s_max"]}


# (benchmark, flags besides --json, check, seconds before it is killed)
BENCHMARKS = [
    pytest.param("train_throughput", ["--quick"], check_train_throughput, 180, id="train_throughput"),
    pytest.param("rollout", ["--quick"], check_rollout, 180, id="rollout"),
    pytest.param("hf_parity", ["--quick"], check_hf_parity, 180, id="hf_parity"),
    pytest.param("reshard", ["--smoke"], check_reshard, 240, id="reshard"),
    pytest.param("scheduling", ["--quick"], check_scheduling, 180, id="scheduling"),
    pytest.param("transfer", ["--quick", "--device", "cpu"], check_transfer, 180, id="transfer"),
    pytest.param("collocated", ["--quick", "--variants", "all", "--steps", "2"], check_collocated, 420,
                 id="collocated", marks=pytest.mark.slow),
    pytest.param("e2e", ["--smoke"], check_e2e, 540, id="e2e", marks=pytest.mark.slow),
    pytest.param("faults", ["--smoke"], check_faults, 570, id="faults", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name, args, check, timeout_s", BENCHMARKS)
def test_benchmark_quick_mode_runs_on_cpu(name: str, args: list[str], check: Callable[[dict], None],
                                          timeout_s: float, tmp_path: Path):
    # the benchmarks' own work folders go to tmp_path (their defaults are under runs/)
    work = {"collocated": ["--work", str(tmp_path / "work")],
            "e2e": ["--out", str(tmp_path / "runs"), "--work", str(tmp_path / "inputs")],
            "faults": ["--work", str(tmp_path / "work")]}.get(name, [])
    check(run_benchmark(name, [*args, *work], tmp_path, timeout_s))
