"""Actor training throughput: tokens/s and MFU of one ActorShard (tp=1, dp=1) in bf16 on one GPU.

    python benchmarks/train_throughput.py --json out.json            # ~0.6B model, bf16, cuda:0
    python benchmarks/train_throughput.py --quick --json out.json    # tiny fp32 model on CPU (testable here)
    python benchmarks/train_throughput.py --configs 16x8,32x4 --json out.json  # micro-batch x micro-batches per iter

`--configs` runs every micro-batch setting in one process, one after the other (each with its own shard, warm-up
and timed iters; memory is released between them); the JSON's top level reports the setting with the most
tokens/s and `configs` lists them all.

Each iter is a full `ActorShard.train_iter` (forward + backward per micro-batch, fp32 grad accumulation, clip,
ZeRO-1 AdamW on fp32 master weights, bf16 params republished). FLOPs per iter = 6 * N * tokens (N: parameters
doing matmuls, i.e. all but the input embedding) + 12 * L * hidden * T * tokens (attention scores and values,
PaLM's formula; no causal discount). MFU = FLOP/s / peak (790 TFLOP/s dense bf16 on H200 by default).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from tidal.engine.model import ModelArgs

BIG = ModelArgs(vocab_size=32000, hidden_size=1536, num_layers=20, num_heads=12, num_kv_heads=4,
                intermediate_size=4096, max_seq_len=1024)
TINY = ModelArgs(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, max_seq_len=64)


def _body(rank, world, args_dict, configs, iters, warmup, backend):
    from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig
    args = ModelArgs(**args_dict)
    device = torch.device("cuda:0") if backend == "nccl" else torch.device("cpu")
    seq = args.max_seq_len
    out = []
    for micro_batch, num_mb in configs:
        shard = ActorShard(args, OptimConfig(lr=1e-4, warmup_iters=2, total_iters=iters + warmup),
                           Layout(1, 1, (0,)), 0, device=device)
        g = torch.Generator().manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for _ in range(warmup + iters):
            mbs = [torch.randint(0, args.vocab_size, (micro_batch, seq), generator=g).to(device)
                   for _ in range(num_mb)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rep = shard.train_iter(SharedQueue(mbs), nll_loss, num_mb * micro_batch * (seq - 1))
            times.append(time.perf_counter() - t0)  # train_iter synchronizes the device before returning
            losses.append(rep.loss)
        mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        out.append({"micro_batch": micro_batch, "num_mb": num_mb, "seconds": times[warmup:], "losses": losses,
                    "max_mem_bytes": mem, "dtype": str(shard.dtype)})
        shard.free()
        del shard, mbs
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
    p.add_argument("--configs", default=None,
                   help="comma-separated MBxN settings (sequences per micro-batch x micro-batches per iter); "
                        "default 16x8,32x4,32x8 on GPU, 4x4 on CPU")
    p.add_argument("--micro-batch", type=int, default=None, help="one setting: sequences per micro-batch")
    p.add_argument("--num-mb", type=int, default=None, help="one setting: micro-batches per iter")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak of the GPU")
    p.add_argument("--json", dest="json_path")
    ns = p.parse_args(argv)
    from tidal.cli.reshard_check import run_world
    cuda = torch.cuda.is_available() and not ns.quick
    args = TINY if not cuda else BIG
    if ns.micro_batch or ns.num_mb:
        if ns.configs:
            raise SystemExit("error: give either --configs or --micro-batch/--num-mb, not both")
        configs = [(ns.micro_batch or (16 if cuda else 4), ns.num_mb or (8 if cuda else 4))]
    else:
        configs = _parse_configs(ns.configs or ("16x8,32x4,32x8" if cuda else "4x4"))
    backend = "nccl" if cuda else "gloo"
    r = run_world(1, backend, _body, args.__dict__, configs, ns.iters, ns.warmup, backend)[0]
    n_params = args.num_params()
    n_matmul = n_params - args.vocab_size * args.hidden_size * (0 if args.tie_embeddings else 1)
    rows = []
    for c in r["configs"]:
        tokens = c["num_mb"] * c["micro_batch"] * args.max_seq_len
        flops = 6 * n_matmul * tokens + 12 * args.num_layers * args.hidden_size * args.max_seq_len * tokens
        sec = statistics.median(c["seconds"])
        rows.append({"micro_batch": c["micro_batch"], "num_mb": c["num_mb"], "dtype": c["dtype"],
                     "tokens_per_iter": tokens, "iter_seconds": sec, "iter_seconds_all": c["seconds"],
                     "tokens_per_s": tokens / sec, "tflops": flops / sec / 1e12,
                     "mfu": flops / sec / (ns.peak_tflops * 1e12) if cuda else None,
                     "max_mem_gb": c["max_mem_bytes"] / 2**30, "losses": c["losses"]})
        print(f"{n_params / 1e6:.1f}M params {c['dtype']} on {r['device']}, micro-batch {c['micro_batch']} x "
              f"{c['num_mb']}: {tokens / sec:.0f} tokens/s, {flops / sec / 1e12:.1f} TFLOP/s"
              + (f", MFU {rows[-1]['mfu']:.1%}" if cuda else "") + f", iter {sec:.3f} s, "
              f"peak {rows[-1]['max_mem_gb']:.1f} GiB", flush=True)
    best = max(rows, key=lambda row: row["tokens_per_s"])
    out = {"name": "train_throughput", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.node()} {os.cpu_count()} cpu, {r['device']}, torch {torch.__version__}",
           "model": args.__dict__, "num_params": n_params, "peak_tflops": ns.peak_tflops, "iters": ns.iters,
           "warmup": ns.warmup, "best": f"{best['micro_batch']}x{best['num_mb']}",
           **{k: v for k, v in best.items() if k != "iter_seconds_all"}, "configs": rows}
    print(f"best: micro-batch {out['best']}: {best['tokens_per_s']:.0f} tokens/s"
          + (f", MFU {best['mfu']:.1%}" if cuda else ""))
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
