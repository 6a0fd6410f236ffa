"""Decode attention kernel sweep (CUDA): the Triton split-K kernel's launch knobs against the KV-read bound, beside
the SDPA call it replaces.

    python benchmarks/decode_attention.py --json out.json     # Qwen2.5-1.5B's attention shape, batch 64 and 256

Per shape (`--batch` x `--context`, every row at position context - 1, as in a greedy benchmark) and per config
(`chunk` keys per stage-1 program, `block_n` keys per online-softmax block, `num_warps`, `num_stages`): `--layers`
calls of `decode_attention_fused`, each over its own layer's K/V cache ([batch + 1, kv heads, --max-seq-len, head
dim] bf16, random), captured in one CUDA graph as the engine's decode step captures them, the graph replayed
`--repeats` times between CUDA events; `us` = the median replay / layers. The caches of all layers together exceed
the L2 cache, so each call reads its keys from device memory as in a real step. `bound_us`: one read of the
visible keys and values (batch x context x 2 x kv heads x head dim x 2 bytes) at the copy bandwidth measured in the
same run (`copy_bandwidth_GBps`, as `benchmarks/rollout.py`); `bound_ratio` = bound_us / us. `rel_err`: ||out -
ref|| / ||ref|| against fp32 attention on the first layer (bf16 inputs: ~1e-3 expected). `sdpa`: the engine's
step-wide SDPA call (`kv_cache.decode_attention`, additive mask over the span) timed the same way (it does not
write the new K/V; the engine adds two `index_copy_` per layer for that). `best`: per shape, the fastest config.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics

import torch
from rollout import copy_bandwidth, machine  # benchmarks/ is the script's folder

from tidal.core.provenance import commit
from tidal.engine.generation import decode_attention as da
from tidal.engine.generation.kv_cache import decode_attention as sdpa_decode_attention


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None


def graph_us(calls, layers: int, repeats: int) -> float:
    """Median microseconds per call of `calls()` (which launches `layers` calls) replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(times)


def reference(q, k_cache, v_cache, k_new, v_new, pos: int) -> torch.Tensor:
    """fp32 attention of every row (slot = row) over keys 0..pos, key pos being the new K/V."""
    r, h, d = q.shape
    kv = k_new.shape[1]
    k = k_cache[:r, :, :pos + 1].float().clone()
    v = v_cache[:r, :, :pos + 1].float().clone()
    k[:, :, pos], v[:, :, pos] = k_new.float(), v_new.float()
    qg = q.float().reshape(r, kv, h // kv, d)
    s = torch.einsum("rkgd,rksd->rkgs", qg, k) / d ** 0.5
    return torch.einsum("rkgs,rksd->rkgd", s.softmax(-1), v).reshape(r, h, d)


def sweep_shape(a, batch: int, context: int, bandwidth: float, configs) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(batch * 10_000 + context)
    h, kv, d, L = a.heads, a.kv_heads, a.head_dim, a.layers

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)

    caches = [(rand(batch + 1, kv, a.max_seq_len, d), rand(batch + 1, kv, a.max_seq_len, d)) for _ in range(L)]
    qs = [(rand(batch, h, d), rand(batch, kv, d), rand(batch, kv, d)) for _ in range(L)]
    slots = torch.arange(batch, device=dev)
    pos = context - 1
    pos_R = torch.full((batch,), pos, device=dev)
    ref = reference(*qs[0][:1], *caches[0], *qs[0][1:], pos)
    bound_us = batch * context * 2 * kv * d * 2 / bandwidth * 1e6
    rows = []
    for chunk, block_n, warps, stages in configs:
        kw = dict(chunk=chunk, block_n=block_n, num_warps=warps, num_stages=stages)
        out = da.decode_attention_fused(*qs[0], *caches[0], slots, pos_R, context, **kw)
        rel = float((out.float() - ref).norm() / ref.norm())

        def calls(kw=kw):
            for (q, kn, vn), (kc, vc) in zip(qs, caches):
                da.decode_attention_fused(q, kn, vn, kc, vc, slots, pos_R, context, **kw)

        try:
            us = graph_us(calls, L, a.repeats)
        except Exception as e:   # a config the compiler refuses (shared memory): recorded, not fatal
            rows.append({**kw, "refused": str(e)[:200]})
            continue
        rows.append({**kw, "us": us, "bound_ratio": bound_us / us, "rel_err": rel})
        print(f"b{batch} ctx{context} {kw}: {us:.1f} us ({bound_us / us:.2f} of bound), rel_err {rel:.1e}",
              flush=True)
    mask = (torch.arange(context, device=dev) <= pos)[None, None, None, :].expand(batch, 1, 1, context)
    additive = torch.zeros(mask.shape, device=dev, dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))

    def sdpa_calls():
        for (q, _, _), (kc, vc) in zip(qs, caches):
            sdpa_decode_attention(q[:, :, None], kc[:batch, :, :context], vc[:batch, :, :context], additive)

    sdpa_us = graph_us(sdpa_calls, L, a.repeats)
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"])
    return {"batch": batch, "context": context, "bound_us": bound_us,
            "sdpa": {"us": sdpa_us, "bound_ratio": bound_us / sdpa_us},
            "default": next((r for r in timed if (r["chunk"], r["block_n"], r["num_warps"], r["num_stages"]) ==
                             (da.CHUNK, da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES)), None),
            "best": best, "configs": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--batch", type=ints, default=[64, 256])
    p.add_argument("--context", type=ints, default=[768, 1280], help="keys per row (position + 1)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--max-seq-len", type=int, default=1280)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--chunk", type=ints, default=[128, 256, 512])
    p.add_argument("--block-n", type=ints, default=[32, 64, 128])
    p.add_argument("--num-warps", type=ints, default=[2, 4, 8])
    p.add_argument("--num-stages", type=ints, default=[1, 2, 3])
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py: needs a CUDA device (the kernel is Triton on the GPU)")
    if max(a.context) > a.max_seq_len:
        raise SystemExit(f"--context {max(a.context)} exceeds --max-seq-len {a.max_seq_len}")
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev) * 1e9
    configs = [c for c in itertools.product(a.chunk, a.block_n, a.num_warps, a.num_stages) if c[1] <= c[0]]
    shapes = [sweep_shape(a, b, c, bandwidth, configs) for b in a.batch for c in a.context]
    report = {"name": "decode_attention", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "machine": machine(dev), "copy_bandwidth_GBps": bandwidth / 1e9,
              "shape": {"heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "layers": a.layers,
                        "max_seq_len": a.max_seq_len, "dtype": "bfloat16"},
              "shapes": shapes}
    for s in shapes:
        b = s["best"]
        print(f"b{s['batch']} ctx{s['context']}: bound {s['bound_us']:.1f} us, sdpa {s['sdpa']['us']:.1f} us, "
              f"default {s['default'] and round(s['default']['us'], 1)} us, best {b['us']:.1f} us "
              f"({b['bound_ratio']:.2f}) chunk {b['chunk']} block_n {b['block_n']} warps {b['num_warps']} "
              f"stages {b['num_stages']}")
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
