"""Actor training throughput: tokens/s, MFU and peak memory of one ActorShard (tp=1, dp=1) in bf16 on one GPU.

    python benchmarks/train_throughput.py --json out.json            # ~0.6B model, bf16, cuda:0
    python benchmarks/train_throughput.py --quick --json out.json    # tiny fp32 model on CPU (testable here)
    python benchmarks/train_throughput.py --configs 16x8,32x4 --json out.json  # micro-batch x micro-batches per iter
    python benchmarks/train_throughput.py --model qwen2.5-1.5b --configs 4x4,8x2 --activation-checkpointing both \\
        --json out.json    # the Qwen2.5-1.5B shape, 2,048-token sequences, with and without recompute

`--configs` runs every micro-batch setting in one process, one after the other (each with its own shard, warm-up
and timed iters; memory is released between them); `--activation-checkpointing both` runs each setting without and
then with recompute of each layer's activations in the backward. The JSON's top level reports the run with the
most tokens/s (`best`: MBxN, `+ac` with activation checkpointing) and `configs` lists them all.

Every row of a micro-batch is one whole sequence of `--seq-len` tokens (default: the model's `max_seq_len`, 2,048
for qwen2.5-1.5b), packed full: no padding, so every token is trained on. Each iter is a full
`ActorShard.train_iter` (forward + backward per micro-batch, fp32 grad accumulation, clip, ZeRO-1 AdamW on fp32
master weights, bf16 params republished). FLOPs per iter = 6 * N * tokens + 12 * L * hidden * T * tokens
(attention scores and values, PaLM's formula; T = seq_len, no causal discount), where N (`matmul_params` in the
JSON) is every parameter but the input embedding: the input lookup is no matmul, while the output head (vocab x
hidden) is one and is counted, whether it is its own matrix or the tied embedding (norm weights are in N too, under
0.01%). Recompute is not counted (model FLOPs), so activation checkpointing costs MFU. `mfu` = FLOP/s over the
chip's datasheet dense bf16 peak (989 TFLOP/s on H100/H200; `--peak-tflops` for another chip); `mfu_of_gemm` over
the bf16 GEMM rate measured on the card in the same run (benchmarks/mfu.py). `peak_bytes` / `peak_GiB`: the device's
peak allocated memory over the timed iters (null on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

from tidal.core.provenance import commit
from tidal.engine.model import ModelArgs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # benchmarks/: the MFU references
from mfu import MFUReference, mfu_reference_in_child

BIG = ModelArgs(vocab_size=32000, hidden_size=1536, num_layers=20, num_heads=12, num_kv_heads=4,
                intermediate_size=4096, max_seq_len=1024)
#: the Qwen2.5-1.5B shape (tied embeddings, vocab 151,936): `--model qwen2.5-1.5b`
QWEN25_1_5B = ModelArgs(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                        intermediate_size=8960, tie_embeddings=True, rope_theta=1e6, max_seq_len=2048)
TINY = ModelArgs(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, max_seq_len=64)
CHECKPOINTING = {"off": (False,), "on": (True,), "both": (False, True)}


def _body(rank, world, args_dict, seq, configs, iters, warmup, backend):
    from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig
    args = ModelArgs(**args_dict)
    device = torch.device("cuda:0") if backend == "nccl" else torch.device("cpu")
    cuda = device.type == "cuda"
    out = []
    for micro_batch, num_mb, checkpointing in configs:
        shard = ActorShard(args, OptimConfig(lr=1e-4, warmup_iters=2, total_iters=iters + warmup),
                           Layout(1, 1, (0,)), 0, device=device, activation_checkpointing=checkpointing)
        row = {"micro_batch": micro_batch, "num_mb": num_mb, "activation_checkpointing": checkpointing,
               "dtype": str(shard.dtype)}
        g = torch.Generator().manual_seed(0)
        times, losses = [], []
        try:
            for i in range(warmup + iters):
                mbs = [torch.randint(0, args.vocab_size, (micro_batch, seq), generator=g).to(device)
                       for _ in range(num_mb)]
                if cuda:
                    torch.cuda.synchronize()
                    if i == warmup:
                        torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                rep = shard.train_iter(SharedQueue(mbs), nll_loss, num_mb * micro_batch * (seq - 1))
                times.append(time.perf_counter() - t0)  # train_iter synchronizes the device before returning
                losses.append(rep.loss)
            row.update(seconds=times[warmup:], losses=losses,
                       peak_bytes=torch.cuda.max_memory_allocated() if cuda else None)
        except torch.OutOfMemoryError as e:  # one setting too large must not lose the others' numbers
            row["error"] = f"out of memory: {str(e).splitlines()[0]}"
        shard.free()
        del shard
        mbs = None
        if cuda:
            torch.cuda.empty_cache()
        out.append(row)
    return {"configs": out, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}


def _parse_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for item in text.split(","):
        try:
            mb, n = (int(x) for x in item.strip().lower().split("x"))
        except ValueError:
            raise SystemExit(f"error: --configs item {item!r} is not MBxN (e.g. 16x8: 16 sequences per "
                             f"micro-batch, 8 micro-batches per iter)") from None
        if mb < 1 or n < 1:
            raise SystemExit(f"error: --configs item {item!r}: both numbers must be >= 1")
        configs.append((mb, n))
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny fp32 model on CPU")
    p.add_argument("--model", choices=("default", "qwen2.5-1.5b"), default="default",
                   help="default: a ~0.6B model on GPU (the tiny one with --quick or on CPU)")
    p.add_argument("--configs", default=None,
                   help="comma-separated MBxN settings (sequences per micro-batch x micro-batches per iter); "
                        "default 16x8,32x4,32x8 on GPU, 4x4 on CPU")
    p.add_argument("--micro-batch", type=int, default=None, help="one setting: sequences per micro-batch")
    p.add_argument("--num-mb", type=int, default=None, help="one setting: micro-batches per iter")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--activation-checkpointing", choices=tuple(CHECKPOINTING), default="off",
                   help="recompute each layer's activations in the backward; both: every setting without, then with")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the GPU's datasheet (default: benchmarks/mfu.py's table by device name)")
    p.add_argument("--json", dest="json_path")
    ns = p.parse_args(argv)
    from tidal.cli.reshard_check import run_world
    cuda = torch.cuda.is_available() and not ns.quick
    args = QWEN25_1_5B if ns.model == "qwen2.5-1.5b" else BIG if cuda else TINY
    seq = ns.seq_len or args.max_seq_len
    if seq < 2:
        p.error("--seq-len must be >= 2 (the loss predicts each next token)")
    args = dataclasses.replace(args, max_seq_len=max(seq, args.max_seq_len))
    if ns.micro_batch or ns.num_mb:
        if ns.configs:
            raise SystemExit("error: give either --configs or --micro-batch/--num-mb, not both")
        settings = [(ns.micro_batch or (16 if cuda else 4), ns.num_mb or (8 if cuda else 4))]
    else:
        settings = _parse_configs(ns.configs or ("16x8,32x4,32x8" if cuda else "4x4"))
    configs = [(mb, n, ac) for mb, n in settings for ac in CHECKPOINTING[ns.activation_checkpointing]]
    backend = "nccl" if cuda else "gloo"
    ref = mfu_reference_in_child() if cuda else MFUReference("cpu", None, None)
    if ns.peak_tflops is not None:
        ref = dataclasses.replace(ref, datasheet_tflops=ns.peak_tflops)
    r = run_world(1, backend, _body, dataclasses.asdict(args), seq, configs, ns.iters, ns.warmup, backend)[0]
    n_params = args.num_params()
    # the input embedding is a lookup; a tied embedding stays in N as the output head's matmul
    n_matmul = n_params - args.vocab_size * args.hidden_size * (0 if args.tie_embeddings else 1)
    rows = []
    for c in r["configs"]:
        name = f"{c['micro_batch']}x{c['num_mb']}" + ("+ac" if c["activation_checkpointing"] else "")
        tokens = c["num_mb"] * c["micro_batch"] * seq
        row = {"config": name, "micro_batch": c["micro_batch"], "num_mb": c["num_mb"],
               "activation_checkpointing": c["activation_checkpointing"], "dtype": c["dtype"],
               "tokens_per_iter": tokens}
        if "error" in c:
            rows.append({**row, "error": c["error"]})
            print(f"{name}: {c['error']}", flush=True)
            continue
        flops = 6 * n_matmul * tokens + 12 * args.num_layers * args.hidden_size * seq * tokens
        sec = statistics.median(c["seconds"])
        peak = c["peak_bytes"]
        row.update(iter_seconds=sec, iter_seconds_all=c["seconds"], tokens_per_s=tokens / sec,
                   tflops=flops / sec / 1e12, mfu=ref.mfu(flops / sec), mfu_of_gemm=ref.of_gemm(flops / sec),
                   peak_bytes=peak, peak_GiB=peak / 2**30 if peak is not None else None, losses=c["losses"])
        row["max_mem_gb"] = row["peak_GiB"]
        rows.append(row)
        print(f"{n_params / 1e6:.1f}M params {c['dtype']} on {r['device']}, seq {seq}, micro-batch {name}: "
              f"{tokens / sec:.0f} tokens/s, {flops / sec / 1e12:.1f} TFLOP/s"
              + (f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else "") + f", iter {sec:.3f} s"
              + (f", peak {row['peak_GiB']:.1f} GiB" if peak is not None else ""), flush=True)
    done = [row for row in rows if "error" not in row]
    best = max(done, key=lambda row: row["tokens_per_s"]) if done else {}
    out = {"name": "train_throughput", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "commit": commit(),
           "machine": f"{platform.node()} {os.cpu_count()} cpu, {r['device']}, torch {torch.__version__}",
           "command": shlex.join(["python", "benchmarks/train_throughput.py",
                                  *(sys.argv[1:] if argv is None else argv)]),
           "model": dataclasses.asdict(args), "seq_len": seq, "num_params": n_params, "matmul_params": n_matmul,
           "mfu_reference": ref.to_json(), "iters": ns.iters, "warmup": ns.warmup, "best": best.get("config"),
           **{k: v for k, v in best.items() if k not in ("config", "iter_seconds_all")}, "configs": rows}
    if best:
        print(f"best: micro-batch {out['best']}: {best['tokens_per_s']:.0f} tokens/s"
              + (f", MFU {best['mfu']:.1%}" if best["mfu"] is not None else ""))
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if best else 1


if __name__ == "__main__":
    sys.exit(main())
