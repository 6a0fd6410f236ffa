"""Collocated GRPO on one device: per-phase seconds and peak device memory with and without each actor offload key.

    python benchmarks/collocated.py --json benchmarks/results/collocated/<date>_<commit7>_<machine>.json
    python benchmarks/collocated.py --quick --json /tmp/collocated.json          # CPU smoke run, tiny model

Every variant is a real `tidal train` run (`tidal.pipeline.run.TrainingRun`: Ray worker, the native engine, the
actor) with `"actor,rollout,inference": 0` on one device, the same seeds and data, differing only in the
`actor.offload_*` keys: `none`, `optimizer`, `grad`, `weight`, `all`. Each step on the device, in turn:

    to_generation   actor state -> pinned host memory (the keys set), engines built from a local copy
    generate        rollout, every group of the step
    score           inference with the rollout engine's model (its KV cache freed first)
    to_training     engines released, actor state back on the device
    train           n_minibatches iters

Figures per variant (steps >= 1; step 0 warms up): step seconds, the driver's phase seconds, the hand-over
seconds (offload, onload: the workers' copies; and the driver's span of the hand-over to training), and from
the hand-over events: the actor's bytes left on the device while it generates (`actor_resident`) and the
device's peak during training (`train_peak`, CUDA). Goals: actor_resident / train_peak < 0.1 with the offloads
on, and (offload + onload) / step < 0.1. Every variant must end with the same weights (the offloads are exact).

Model: a Qwen2.5-1.5B-shaped Hugging Face checkpoint (`--model qwen2.5-0.5b`: 0.5B; random weights, written by
`transformers`) with a small BPE tokenizer, on GSM8K-format addition problems (`--quick`: a tiny Qwen2 on CPU).
A random model earns none of the task's reward, so its steps would train nothing: the reward is `parity` by default
(1 for a response of even length, about half of every group), so every iter has a gradient and the variants' equal
final weights say something; `every_iter_trained` records that every iter's gradient norm was finite and non-zero.
`--reward task` takes the GSM8K verifier instead.

Backends (`--backends native,megatron`: `actor.backend`; variants named `<backend>-<variant>`): each variant per
backend, and `backend_parity`: per actor iter (from the run's `iter` events) loss, gradient norm, tokens/s and
MFU of both, with the loss's absolute and the gradient norm's relative difference (GRPO's loss is near 0
on-policy). Step 0's iters see the same samples in both runs (same weights and
seeds); later rollouts come from weights that differ by round-off, so later iters may train on other samples
(`same_tokens`). MFU per iter: model FLOPs (6 N + 12 L hidden T per token, T the iter's mean sequence length, as
benchmarks/train_throughput.py) over the iter's seconds, against the chip's datasheet dense bf16 peak (`mfu`,
989 TFLOP/s on H100/H200) and the bf16 GEMM rate measured on the card in the same run (`mfu_of_gemm`;
benchmarks/mfu.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from tidal.core.provenance import commit

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: the shared inputs
import hf_inputs
from hf_inputs import PARITY_REWARD, TINY, make_inputs, matmul_params
from mfu import MFUReference, mfu_reference_in_child

VARIANTS = {"none": {}, "optimizer": {"offload_optimizer": True}, "grad": {"offload_grad": True},
            "weight": {"offload_weight": True},
            "all": {"offload_optimizer": True, "offload_grad": True, "offload_weight": True}}
MODELS = {k: v for k, v in hf_inputs.MODELS.items() if k != "tiny"}
BACKENDS = ("native", "megatron")


def machine() -> str:
    import torch
    info = f"{os.cpu_count()} {platform.machine()} CPU cores, torch {torch.__version__}"
    if torch.cuda.is_available():
        info = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, " + info
    return info


def build(variant: str, a: argparse.Namespace, inputs: tuple[Path, Path, Path], out: Path, backend: str = "native"):
    from tidal.core.config import build_config
    ckpt, train, val = inputs
    return build_config({
        "run": {"name": f"collocated-{backend}-{variant}", "num_steps": a.steps, "seed": 0, "output_dir": str(out),
                "eval_every": 10_000},
        "cluster": {"num_devices_per_node": 1, "device": a.device,
                    "component_placement": {"actor,rollout,inference": "0"}},
        "model": {"path": str(ckpt)},
        "data": {"train_files": [str(train)], "val_files": [str(val)], "prompt_key": "question",
                 "max_prompt_length": 32, "rollout_batch_size": a.prompts, "eval_size": 8, "seed": 0},
        "actor": {"micro_batch_size": a.micro_batch, "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
                  "activation_checkpointing": a.activation_checkpointing, "lr": 1e-6, "warmup_iters": 0,
                  "backend": backend, **VARIANTS[variant]},
        "rollout": {"max_new_tokens": a.new_tokens, "max_running_requests": a.prompts * a.group_size,
                    "gpu_memory_utilization": a.gpu_memory_utilization},
        "algorithm": {"group_size": a.group_size, "n_minibatches": 2},
        "warm_start": {"iters": 0},
        **({"reward": {"function": PARITY_REWARD}} if a.reward == "parity" else {}),
    }, [])


def run_variant(variant: str, a: argparse.Namespace, inputs, out: Path, backend: str = "native") -> dict:
    from tidal.pipeline.run import TrainingRun
    cfg = build(variant, a, inputs, out, backend)
    run = TrainingRun(cfg, out / cfg.run.name)
    steps = []
    try:
        t0 = time.monotonic()
        run.open()
        open_s = time.monotonic() - t0
        for _ in range(a.steps):
            run.step()
            res = run._res
            events = run.pipe.cluster.events
            to_train = next(e for e in events if e["kind"] == "handover" and e["direction"] == "to_training"
                            and e["step"] == res.step)
            to_gen = next(e for e in events if e["kind"] == "handover" and e["direction"] == "to_generation"
                          and e["step"] == res.step + 1)   # the weight sync at this step's end
            # the driver's span of the hand-over to training (it ends as its event is recorded)
            span = min((sp for sp in run.pipe.timeline.busy if sp.what == "hand-over"),
                       key=lambda sp: abs(sp.t1 - to_train["time"]))
            span = span.t1 - span.t0
            sync = [e["seconds"] for e in events if e["kind"] == "weight_sync" and e["step"] == res.step]
            work = {k: v for k, v in res.metrics.items() if k.startswith("work/")}
            response_tokens = res.metrics["step/tokens_per_s"] * res.seconds
            phase = res.phase_seconds
            rates = {"rollout": response_tokens / phase["rollout"] if phase.get("rollout") else None,
                     "inference": work["work/inference_tokens"] / phase["inference"] if phase.get("inference")
                     else None,
                     "actor": work["work/actor_tokens"] / phase["actor"] if phase.get("actor") else None}
            steps.append({"step": res.step, "seconds": res.seconds, "phase_seconds": res.phase_seconds,
                          "response_tokens": response_tokens, "work": work, "tokens_per_s": rates,
                          # where the rollout instance's time went: generating, call overhead, waiting for a call
                          "rollout_time": {k: v for k, v in res.metrics.items() if k.startswith("rollout/")},
                          "weight_sync_s": sum(sync),
                          "offload_s": to_gen["seconds"], "onload_s": to_train["seconds"],
                          "offload_bytes": to_gen["bytes"], "onload_bytes": to_train["bytes"],
                          "to_training_span_s": span,
                          "actor_resident_bytes": to_gen["actor_resident"],
                          "train_peak_bytes": to_gen.get("phase_peak", 0.0),
                          "generate_score_peak_bytes": to_train.get("phase_peak", 0.0),
                          "reward_mean": run.rewards[-1] if run.rewards else 0.0,
                          "iters": [iter_figures(e, a) for e in events
                                    if e["kind"] == "iter" and e["step"] == res.step]})
            print(f"  [{variant}] step {res.step}: {res.seconds:.2f}s, offload {to_gen['seconds']:.3f}s, onload "
                  f"{to_train['seconds']:.3f}s, actor resident {to_gen['actor_resident'] / 2**30:.2f} GiB, train "
                  f"peak {to_gen.get('phase_peak', 0.0) / 2**30:.2f} GiB", flush=True)
        summary = run.finish()
    finally:
        run.close()
    measured = steps[1:] or steps
    mean = statistics.mean
    step_s = mean(s["seconds"] for s in measured)
    train_peak = max(s["train_peak_bytes"] for s in measured)
    resident = max(s["actor_resident_bytes"] for s in measured)
    iters = [i for s in measured for i in s["iters"]]
    return {"variant": variant, "backend": backend, "offload": VARIANTS[variant], "open_s": open_s,
            "step_s": step_s,
            "actor_iter_tokens_per_s": mean(i["tokens_per_s"] for i in iters) if iters else None,
            "actor_mfu": _mean_of(iters, "mfu"), "actor_mfu_of_gemm": _mean_of(iters, "mfu_of_gemm"),
            "phase_seconds": {k: mean(s["phase_seconds"].get(k, 0.0) for s in measured)
                              for k in sorted({k for s in measured for k in s["phase_seconds"]})},
            "offload_s": mean(s["offload_s"] for s in measured), "onload_s": mean(s["onload_s"] for s in measured),
            "handover_fraction": mean((s["offload_s"] + s["onload_s"]) / s["seconds"] for s in measured),
            "weight_sync_s": mean(s["weight_sync_s"] for s in measured),
            "tokens_per_s": {k: mean(s["tokens_per_s"][k] for s in measured if s["tokens_per_s"][k])
                             for k in ("rollout", "inference", "actor")
                             if any(s["tokens_per_s"][k] for s in measured)},
            "actor_resident_bytes": resident, "train_peak_bytes": train_peak,
            "generate_score_peak_bytes": max(s["generate_score_peak_bytes"] for s in measured),
            "resident_over_train_peak": resident / train_peak if train_peak else None,
            "final_weights_sha": summary.final_weights_sha, "steps": steps}


def _mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.mean(vals) if vals else None


def iter_figures(e: dict, a: argparse.Namespace) -> dict:
    """One actor iter from its event: loss, gradient norm, tokens/s (real tokens over the iter's seconds) and MFU
    (model FLOPs, as benchmarks/train_throughput.py: 6 N per token + 12 L hidden T per token, T the iter's mean
    sequence length; CUDA only)."""
    ref: MFUReference = a.mfu_ref
    shape = a.shape
    seqs = a.prompts * a.group_size / 2   # n_minibatches 2
    flops = (6 * matmul_params(shape) + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * e["tokens"] / seqs
             ) * e["tokens"]
    return {"step": e["step"], "iter": e["iter"], "loss": e.get("loss"), "grad_norm": e.get("grad_norm"),
            "tokens": e["tokens"], "seconds": e["seconds"], "tokens_per_s": e["tokens"] / e["seconds"],
            "mfu": ref.mfu(flops / e["seconds"]), "mfu_of_gemm": ref.of_gemm(flops / e["seconds"])}


def backend_parity(variants: dict) -> dict | None:
    """Per iter, megatron against native on the same variant: loss and gradient norm, relative differences. Step
    0's iters train on the same samples (both runs start from the same weights and seeds); later steps' rollouts
    come from weights that already differ by round-off, so their samples may differ (`same_tokens` says)."""
    pairs = [(variants[k], variants[f"megatron-{k[len('native-'):]}"]) for k in variants
             if k.startswith("native-") and f"megatron-{k[len('native-'):]}" in variants]
    if not pairs:
        return None
    nat, meg = pairs[0]
    rows = []
    for x, y in zip((i for s in nat["steps"] for i in s["iters"]), (i for s in meg["steps"] for i in s["iters"])):
        rows.append({"step": x["step"], "iter": x["iter"], "same_tokens": x["tokens"] == y["tokens"],
                     "loss": [x["loss"], y["loss"]], "grad_norm": [x["grad_norm"], y["grad_norm"]],
                     "loss_abs_diff": abs(y["loss"] - x["loss"]),
                     "grad_norm_rel_diff": abs(y["grad_norm"] - x["grad_norm"]) / x["grad_norm"],
                     "tokens_per_s": [x["tokens_per_s"], y["tokens_per_s"]], "mfu": [x["mfu"], y["mfu"]]})
    same = [r for r in rows if r["same_tokens"]]
    # GRPO's loss is near 0 on-policy (advantages are centred per group): its difference is absolute
    return {"iters": rows, "columns": "[native, megatron]",
            "max_diff_same_tokens": {"loss_abs": max((r["loss_abs_diff"] for r in same), default=None),
                                     "grad_norm_rel": max((r["grad_norm_rel_diff"] for r in same), default=None)},
            "actor_iter_tokens_per_s": {"native": nat["actor_iter_tokens_per_s"],
                                        "megatron": meg["actor_iter_tokens_per_s"]},
            "actor_mfu": {"native": nat["actor_mfu"], "megatron": meg["actor_mfu"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--quick", action="store_true", help="tiny model on CPU (a smoke run, about 2 min)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="auto", help="cluster.device: auto (the GPU if there is one), cuda, cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=None, help="data.rollout_batch_size")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=None, help="rollout.max_new_tokens")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                    help="actor.max_tokens_per_micro_batch (default: micro_batch_size sequences per micro-batch)")
    ap.add_argument("--activation-checkpointing", action="store_true", help="actor.activation_checkpointing")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--work", default="runs/collocated", help="checkpoint, data and run folders")
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-1.5b", help="the checkpoint's shape")
    ap.add_argument("--backends", default="native", help=f"actor.backend, comma-separated, of {', '.join(BACKENDS)}")
    ap.add_argument("--reward", choices=("task", "parity"), default="parity",
                    help="parity: 1 for a response of even length, so every iter of the random model trains; task: "
                         "the GSM8K verifier (a random model earns none of it: its steps train nothing)")
    a = ap.parse_args(argv)
    if a.reward == "parity":
        hf_inputs.importable_from_root()
    backends = a.backends.split(",")
    if any(b not in BACKENDS for b in backends):
        raise SystemExit(f"--backends: {a.backends!r}: each of {', '.join(BACKENDS)}")
    a.prompts = a.prompts or (4 if a.quick else 16)
    a.new_tokens = a.new_tokens or (16 if a.quick else 256)
    shape = a.shape = TINY if a.quick else MODELS[a.model]
    a.mfu_ref = mfu_reference_in_child()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    inputs = make_inputs(work / ("tiny" if a.quick else a.model), shape)
    make_s = time.monotonic() - t0
    res = {"name": "collocated", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": commit(), "machine": machine(),
           "config": {"model": shape, "weights": "random (transformers init), bf16 checkpoint",
                      "placement": '"actor,rollout,inference": 0 (one device)', "prompts": a.prompts,
                      "group_size": a.group_size, "max_new_tokens": a.new_tokens, "n_minibatches": 2,
                      "micro_batch_size": a.micro_batch, "gpu_memory_utilization": a.gpu_memory_utilization,
                      "max_tokens_per_micro_batch": a.max_tokens_per_micro_batch,
                      "activation_checkpointing": a.activation_checkpointing,
                      "steps": a.steps, "step_figures": "means over steps >= 1 (step 0: warm-up)",
                      "checkpoint_made_s": make_s, "backends": backends, "reward": a.reward,
                      "mfu_reference": a.mfu_ref.to_json()},
           "variants": {}}
    variants = a.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        raise SystemExit(f"--variants: {a.variants!r}: each of {', '.join(VARIANTS)}")
    for b in backends:
        for v in variants:
            res["variants"][v if backends == ["native"] else f"{b}-{v}"] = run_variant(v, a, inputs, work, b)
            res["backend_parity"] = backend_parity(res["variants"])
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=1))   # what is done so far survives a cut-off run
    # the offloads are exact: each backend's variants end with the same weights (two backends differ by round-off)
    norms = [i["grad_norm"] for r in res["variants"].values() for s in r["steps"] for i in s["iters"]]
    res["every_iter_trained"] = bool(norms) and all(n is not None and math.isfinite(n) and n > 0 for n in norms)
    res["same_final_weights"] = all(len({r["final_weights_sha"] for r in res["variants"].values()
                                         if r["backend"] == b}) == 1 for b in backends)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    gib = 2 ** 30
    print(f"{'variant':<10} {'step s':>7} {'offload s':>9} {'onload s':>8} {'hand-over/step':>14} "
          f"{'actor resident GiB':>18} {'train peak GiB':>14} {'resident/peak':>13}")
    for v, r in res["variants"].items():
        ratio = r["resident_over_train_peak"]
        print(f"{v:<10} {r['step_s']:7.2f} {r['offload_s']:9.3f} {r['onload_s']:8.3f} {r['handover_fraction']:14.3f} "
              f"{r['actor_resident_bytes'] / gib:18.2f} {r['train_peak_bytes'] / gib:14.2f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>13}")
    parity = res.get("backend_parity")
    if parity:
        print(f"megatron vs native, iters on the same samples: max difference "
              f"{parity['max_diff_same_tokens']}; actor tokens/s {parity['actor_iter_tokens_per_s']}, "
              f"MFU {parity['actor_mfu']}")
    print(f"same final weights across variants: {res['same_final_weights']}; every iter trained (finite, non-zero "
          f"gradient norm): {res['every_iter_trained']}")
    return 0 if res["same_final_weights"] and res["every_iter_trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
