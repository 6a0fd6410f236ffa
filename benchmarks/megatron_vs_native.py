"""Megatron backend vs native engine on one device: same weights, same batch -> loss, gradients, a step, throughput.

    python benchmarks/megatron_vs_native.py --json out.json                    # cuda: ~0.6B model, H200 peak
    python benchmarks/megatron_vs_native.py --device cpu --json out.json       # tiny model on CPU (smoke test)

Both engines run at world 1 (tp = dp = 1): `ActorShard` (ours: SDPA attention, ZeRO-1 AdamW on fp32 masters) and
`MegatronBackend` (megatron-core GPTModel with the local spec, i.e. no Transformer Engine: unfused
baddbmm + softmax attention; DDP with fp32 grad buffer; DistributedOptimizer over torch AdamW), loaded with the
same fp32 global weights (`init_global_weights`).

Parity, in fp32 and in bf16 (params and compute in that dtype, fp32 grad accumulation and master weights in
both engines): the iter's loss (sum over micro-batches of token-sum / tokens-in-iter), every parameter's
gradient (Megatron's fused QKV / [gate; up] / padded vocab mapped back to our names with `from_megatron`;
reported as max |diff| and max |diff| / max |native grad| per parameter and the worst over all), then one
training step on each (reported: step loss, grad norm, max weight difference after the step).

Throughput: bf16 on CUDA (the dtype of the CPU run otherwise), micro-batch x micro-batches per iter, warm-up
iters then timed iters of `train_iter` each; tokens/s and MFU = FLOP/s / peak (989 TFLOP/s dense bf16 H200 by
default), FLOPs per iter = 6 * N_matmul * tokens + 12 * L * hidden * T * tokens (as benchmarks/train_throughput.py).
Each section records its error instead of stopping the run, so one failure still leaves the other numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

from tidal.engine.model import ModelArgs

BIG = ModelArgs(vocab_size=32000, hidden_size=1536, num_layers=20, num_heads=12, num_kv_heads=4,
                intermediate_size=4096, max_seq_len=1024)
TINY = ModelArgs(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 intermediate_size=128, max_seq_len=64)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _parity(args: ModelArgs, dtype: torch.dtype, device, parity_mb: tuple[int, int]) -> dict:
    from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
    from tidal.engine.backends.megatron_backend import MegatronBackend
    from tidal.engine.backends.megatron_map import from_megatron
    from tidal.engine.layout import Layout
    from tidal.engine.model import init_global_weights
    from tidal.engine.optim import OptimConfig

    hp = OptimConfig(lr=1e-4, warmup_iters=0, total_iters=10)
    w = init_global_weights(args, 0)
    g = torch.Generator().manual_seed(1)
    mb, n = parity_mb
    mbs = [torch.randint(0, args.vocab_size, (mb, args.max_seq_len), generator=g).to(device) for _ in range(n)]
    ntok = n * mb * (args.max_seq_len - 1)
    lay = Layout(1, 1, (0,))
    nat = ActorShard(args, hp, lay, 0, device=device, dtype=dtype, weights=w)
    acc = {name: torch.zeros(p.shape, dtype=torch.float32, device=device) for name, p in nat.model.named_parameters()}
    loss_n = 0.0
    for x in mbs:  # fp32 accumulation of per-micro-batch grads, as ActorShard.train_iter does
        loss = nll_loss(nat.model, x, ntok)
        loss.backward()
        loss_n += float(loss.detach().double())
        for name, p in nat.model.named_parameters():
            acc[name].add_(p.grad.float())
            p.grad = None
    meg = MegatronBackend(args, hp, lay, 0, device=device, dtype=dtype, weights=w)
    loss_m, _ = meg.forward_backward(SharedQueue(mbs), nll_loss, ntok)
    g_meg = from_megatron({k: v.detach().clone() for k, v in meg.grads().items()}, args)
    per_param = {}
    for name, a in acc.items():
        d = float((a - g_meg[name]).abs().max())
        per_param[name] = {"max_abs": d, "max_rel": d / max(float(a.abs().max()), 1e-30)}
    del g_meg
    rep_n = nat.train_iter(SharedQueue(mbs), nll_loss, ntok)
    rep_m = meg.train_iter(SharedQueue(mbs), nll_loss, ntok)
    w_meg = from_megatron({k: p.detach() for k, p in meg.stack.params.items()}, args)
    w_diff = max(float((p.detach().float() - w_meg[name].float()).abs().max())
                 for name, p in nat.model.named_parameters())
    out = {"dtype": str(dtype), "micro_batch": mb, "num_mb": n, "loss_native": loss_n, "loss_megatron": loss_m,
           "loss_abs_diff": abs(loss_n - loss_m), "loss_rel_diff": abs(loss_n - loss_m) / abs(loss_n),
           "grad_max_abs_diff": max(v["max_abs"] for v in per_param.values()),
           "grad_max_rel_diff": max(v["max_rel"] for v in per_param.values()),
           "grad_worst_param": max(per_param, key=lambda k: per_param[k]["max_rel"]),
           "step": {"native": {"loss": rep_n.loss, "grad_norm": rep_n.grad_norm, "lr": rep_n.lr},
                    "megatron": {"loss": rep_m.loss, "grad_norm": rep_m.grad_norm, "lr": rep_m.lr},
                    "weight_max_abs_diff_after_step": w_diff, "lr": hp.lr},
           "per_param": per_param}
    del nat, meg, acc, w_meg
    _free(device)
    return out


def _throughput(engine: str, args: ModelArgs, dtype, device, micro_batch: int, num_mb: int, iters: int,
                warmup: int) -> dict:
    from tidal.engine.actor import SharedQueue, nll_loss
    from tidal.engine.backends.protocol import make_backend
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig

    hp = OptimConfig(lr=1e-4, warmup_iters=2, total_iters=iters + warmup)
    actor = make_backend(engine, args, hp, Layout(1, 1, (0,)), 0, device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(warmup + iters):
        mbs = [torch.randint(0, args.vocab_size, (micro_batch, args.max_seq_len), generator=g).to(device)
               for _ in range(num_mb)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        rep = actor.train_iter(SharedQueue(mbs), nll_loss, num_mb * micro_batch * (args.max_seq_len - 1))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(rep.loss)
    mem = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    del actor
    _free(device)
    return {"engine": engine, "seconds": times[warmup:], "losses": losses, "max_mem_bytes": mem}


def _body(rank, world, args_dict, device_type, parity_mb, micro_batch, num_mb, iters, warmup):
    import warnings
    warnings.simplefilter("ignore")
    args = ModelArgs(**args_dict)
    device = torch.device("cuda:0") if device_type == "cuda" else torch.device("cpu")
    out = {"device": torch.cuda.get_device_name(0) if device_type == "cuda" else "cpu", "parity": {},
           "throughput": {}, "errors": {}}
    for dtype in (torch.float32, torch.bfloat16):
        try:
            out["parity"][str(dtype)] = _parity(args, dtype, device, parity_mb)
        except Exception:
            out["errors"][f"parity {dtype}"] = traceback.format_exc()
            _free(device)
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    for engine in ("native", "megatron"):
        try:
            out["throughput"][engine] = _throughput(engine, args, dtype, device, micro_batch, num_mb, iters, warmup)
            out["throughput"][engine]["dtype"] = str(dtype)
        except Exception:
            out["errors"][f"throughput {engine}"] = traceback.format_exc()
            _free(device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (16 cuda, 4 cpu)")
    p.add_argument("--num-mb", type=int, default=None, help="micro-batches per iter (8 cuda, 2 cpu)")
    p.add_argument("--parity-batch", default=None, help="MBxN of the parity batch (4x2 cuda, 2x2 cpu)")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H200: 989)")
    p.add_argument("--json", dest="json_path")
    ns = p.parse_args(argv)
    cuda = ns.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible (use --device cpu for the smoke test)")
    args = BIG if cuda else TINY
    mb, n = ns.micro_batch or (16 if cuda else 4), ns.num_mb or (8 if cuda else 2)
    try:
        pmb, pn = (int(x) for x in (ns.parity_batch or ("4x2" if cuda else "2x2")).lower().split("x"))
    except ValueError:
        raise SystemExit(f"error: --parity-batch {ns.parity_batch!r} is not MBxN (e.g. 4x2)") from None
    from tidal.cli.reshard_check import run_world
    r = run_world(1, "nccl" if cuda else "gloo", _body, args.__dict__, ns.device, (pmb, pn), mb, n, ns.iters,
                  ns.warmup, timeout=900)[0]
    n_params = args.num_params()
    n_matmul = n_params - args.vocab_size * args.hidden_size * (0 if args.tie_embeddings else 1)
    tokens = n * mb * args.max_seq_len
    flops = 6 * n_matmul * tokens + 12 * args.num_layers * args.hidden_size * args.max_seq_len * tokens
    for name, par in r["parity"].items():
        print(f"parity {name}: loss {par['loss_native']:.6f} vs {par['loss_megatron']:.6f} "
              f"(rel {par['loss_rel_diff']:.2e}),"
              f" grads max abs {par['grad_max_abs_diff']:.2e}, max rel {par['grad_max_rel_diff']:.2e} "
              f"({par['grad_worst_param']}), weights after one step max abs "
              f"{par['step']['weight_max_abs_diff_after_step']:.2e}")
    for engine, row in r["throughput"].items():
        sec = statistics.median(row["seconds"])
        row.update({"iter_seconds": sec, "tokens_per_iter": tokens, "tokens_per_s": tokens / sec,
                    "tflops": flops / sec / 1e12, "mfu": flops / sec / (ns.peak_tflops * 1e12) if cuda else None,
                    "max_mem_gb": row["max_mem_bytes"] / 2**30})
        print(f"{engine}: {tokens / sec:.0f} tokens/s, {flops / sec / 1e12:.1f} TFLOP/s"
              + (f", MFU {row['mfu']:.1%}" if cuda else "") + f", iter {sec:.3f} s, peak {row['max_mem_gb']:.1f} GiB")
    for where, err in r["errors"].items():
        print(f"ERROR in {where}:\n{err}", file=sys.stderr)
    out = {"name": "megatron_vs_native",
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.node()} {os.cpu_count()} cpu, {r['device']}, torch {torch.__version__}",
           "megatron_core": _megatron_version(), "model": dataclasses.asdict(args), "num_params": n_params,
           "peak_tflops": ns.peak_tflops, "micro_batch": mb, "num_mb": n, "iters": ns.iters, "warmup": ns.warmup,
           **r}
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 1 if r["errors"] else 0


def _megatron_version() -> str:
    try:
        import megatron.core
        return megatron.core.__version__
    except ImportError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
