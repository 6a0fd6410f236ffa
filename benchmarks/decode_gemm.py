"""Decode GEMM sweep (CUDA): the engine's Triton decode GEMMs (`tidal.engine.generation.decode_gemm`) against the
weight-read bound and the cuBLAS path they replace, per projection of a layer.

    python benchmarks/decode_gemm.py --json out.json     # Qwen2.5-1.5B and 7B projections, batch 64 and 256

Per model shape, batch (`--batch`, the decode rows M) and role:

- `qkv`: x @ W_qkv^T + b (packed q/k/v with Qwen2's bias); cuBLAS: `F.linear` with the bias;
- `o`: attn @ W_o^T, then the residual add and the next norm; Triton: split-K partials + `reduce_add_rms_norm`;
  cuBLAS: `F.linear` + the compiled `add_rms_norm` (`tidal.engine.generation.fused`);
- `gate_up`: silu(x @ W_g^T) * (x @ W_u^T); Triton: one kernel; cuBLAS: `F.linear` on the packed weight + the
  compiled `silu_mul`;
- `down`: act @ W_d^T, then the residual add and the next norm, as `o`.

Each is timed as `--layers` calls over distinct weights (together far larger than the L2 cache, so each call reads
its weights from device memory as a decode step does), captured in one CUDA graph, replayed `--repeats` times
between CUDA events: `us` = the median replay / layers. `bound_us` = the role's weight bytes at the copy
bandwidth measured in the same run (`copy_bandwidth_GBps`, as `benchmarks/rollout.py`); `bound_ratio` = bound_us
/ us. `rel_err` = ||out - ref|| / ||ref|| against the fp32 product of the same bf16 inputs (the GEMM output, before
the norm). `row_invariant`: the first row computed alone has the bits it has in the batch. `engine`: the tiling
`decode_gemm.config_for` gives the engine; `best`: the fastest of the sweep (`--block-n`, `--block-k`, `--split`,
`--stages`, `--warps`); `cublas`: the path it replaces. `layer_us`: the four roles summed, per variant.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import shlex
import sys

import torch
from decode_attention import graph_us, ints  # benchmarks/ is the script's folder
from rollout import copy_bandwidth, machine

from tidal.core.provenance import commit
from tidal.engine.generation import decode_gemm as dg
from tidal.engine.generation.fused import compiled_kernels

#: (hidden, q/k/v width, intermediate, layers) of each model shape
SHAPES = {"qwen2.5-1.5b": (1536, (12 + 2 * 2) * 128, 8960, 28), "qwen2.5-7b": (3584, (28 + 2 * 4) * 128, 18944, 28)}
EPS = 1e-6


def role_dims(shape: str, role: str) -> tuple[int, int, int]:
    """(n output columns, k, weight rows) of a role; gate_up's weight holds 2n rows."""
    hidden, qkv, inter, _ = SHAPES[shape]
    # o: both shapes have heads x head_dim = hidden
    return {"qkv": (qkv, hidden, qkv), "o": (hidden, hidden, hidden),
            "gate_up": (inter, hidden, 2 * inter), "down": (hidden, inter, hidden)}[role]


def sweep_role(a, shape: str, role: str, m: int, bandwidth: float) -> dict:
    dev = torch.device("cuda")
    n, k, rows = role_dims(shape, role)
    layers = SHAPES[shape][3]
    g = torch.Generator(device=dev).manual_seed(m * 7 + len(role))

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)

    ws = [rand(rows, k, scale=k ** -0.5) for _ in range(layers)]
    bias = [rand(rows) for _ in range(layers)] if role == "qkv" else [None] * layers
    x = rand(m, k)
    resid, norm_w = rand(m, n), rand(n)
    bound_us = rows * k * 2 / bandwidth * 1e6
    ref = x.float() @ ws[0].float().T
    if bias[0] is not None:
        ref = ref + bias[0].float()
    kernels = compiled_kernels()

    def triton_out(cfg, xx, w, b):
        if role == "qkv":
            return dg.linear(xx, w, b, cfg)
        if role == "gate_up":
            return dg.gate_up_silu(xx, w, cfg)
        return dg.reduce_add_rms_norm(dg.linear_partials(xx, w, cfg), resid[:xx.shape[0]], norm_w, EPS)

    def cublas_out(xx, w, b):
        y = torch.nn.functional.linear(xx, w, b)
        if role == "gate_up":
            return kernels.silu_mul(*y.chunk(2, dim=-1))
        if role in ("o", "down"):
            return kernels.add_rms_norm(resid[:xx.shape[0]], y, norm_w, EPS)
        return y

    def product(cfg) -> torch.Tensor:   # the GEMM output before the norm / SiLU (what ref checks)
        if role in ("o", "down"):
            return dg.linear_partials(x, ws[0], cfg).sum(0)
        if role == "gate_up":
            return dg.linear(x, ws[0][:n], None, dg.GemmConfig(cfg.block_n, cfg.block_k))
        return dg.linear(x, ws[0], bias[0], cfg)

    def timed(fn) -> float:
        def calls():
            for w, b in zip(ws, bias):
                fn(x, w, b)
        return graph_us(calls, layers, a.repeats)

    def entry(cfg) -> dict:
        row = {"block_n": cfg.block_n, "block_k": cfg.block_k, "split_k": cfg.split_k,
               "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        try:
            out = product(cfg).float()
            full = triton_out(cfg, x, ws[0], bias[0])
            alone = triton_out(cfg, x[:1].contiguous(), ws[0], bias[0])
            us = timed(lambda xx, w, b: triton_out(cfg, xx, w, b))
        except Exception as e:   # a config the compiler refuses (shared memory): recorded, not fatal
            return {**row, "refused": str(e)[:200]}
        full_t, alone_t = (full[-1], alone[-1]) if isinstance(full, tuple) else (full, alone)
        ref_n = ref if role != "gate_up" else ref[:, :n]
        return {**row, "us": us, "bound_ratio": bound_us / us,
                "rel_err": float((out - ref_n).norm() / ref_n.norm()),
                "row_invariant": bool(torch.equal(full_t[0], alone_t[0]))}

    split_role = role in ("o", "down")
    configs = []
    for bn, bk, st, wp in itertools.product(a.block_n, a.block_k, a.stages, a.warps):
        if split_role:
            steps = -(-k // bk)
            for s in a.split:
                programs = -(-n // bn) * s
                if 2 <= s <= steps and 64 <= programs <= 1024:
                    configs.append(dg.GemmConfig(block_n=bn, block_k=bk, split_k=s, num_warps=wp, num_stages=st))
        else:
            configs.append(dg.GemmConfig(block_n=bn, block_k=bk, num_warps=wp, num_stages=st))
    rows_out = [entry(c) for c in configs]
    eng_cfg = dg.config_for(role, n, k)
    engine = entry(eng_cfg)
    cublas_us = timed(cublas_out)
    done = [r for r in rows_out if "us" in r]
    best = min(done, key=lambda r: r["us"]) if done else None
    print(f"{shape} M={m} {role}: bound {bound_us:.1f} us, cuBLAS {cublas_us:.1f}, engine {engine.get('us', 0):.1f} "
          f"({engine}), best {best}", flush=True)
    return {"role": role, "n": n, "k": k, "bound_us": bound_us,
            "cublas": {"us": cublas_us, "bound_ratio": bound_us / cublas_us},
            "engine": engine, "best": best, "configs": rows_out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--shapes", default="qwen2.5-1.5b,qwen2.5-7b")
    p.add_argument("--batch", type=ints, default=[64, 256])
    p.add_argument("--roles", default="qkv,o,gate_up,down")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--block-n", type=ints, default=[16, 32, 64])
    p.add_argument("--block-k", type=ints, default=[64, 128, 256])
    p.add_argument("--split", type=ints, default=[2, 3, 4, 6, 8, 12, 16])
    p.add_argument("--stages", type=ints, default=[3, 5])
    p.add_argument("--warps", type=ints, default=[4])
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_gemm.py needs a CUDA device")
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev) * 1e9
    report = {"name": "decode_gemm", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "machine": machine(dev), "copy_bandwidth_GBps": bandwidth / 1e9,
              "command": shlex.join(["python", "benchmarks/decode_gemm.py", *sys.argv[1:]]), "results": []}
    for shape in a.shapes.split(","):
        for m in a.batch:
            roles = [sweep_role(a, shape, role, m, bandwidth) for role in a.roles.split(",")]
            summary = {v: sum(r[v]["us"] for r in roles if r[v] and "us" in r[v]) for v in ("cublas", "engine")}
            summary["best"] = sum(r["best"]["us"] for r in roles if r["best"])
            summary["bound"] = sum(r["bound_us"] for r in roles)
            print(f"{shape} M={m} layer us: {summary}", flush=True)
            report["results"].append({"shape": shape, "batch": m, "layer_us": summary, "roles": roles})
            with open(a.json, "w") as f:   # after each shape: a timed-out call keeps what it measured
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
