"""Rollout benchmark: native engine decode speed against the memory-bandwidth bound and Hugging Face `generate`,
and migration cost (KV move vs re-prefill).

    python benchmarks/rollout.py --quick --json out.json            # CPU, tiny model, < 2 min
    python benchmarks/rollout.py --device cuda --json out.json      # GPU: 16-layer model, batch 64
    python benchmarks/rollout.py --device cuda --model qwen2.5-1.5b --batch 64,256 --prompt-len 256 \\
        --new-tokens 1024 --repeats 2 --no-migration --json out.json    # Qwen2.5-1.5B shape, decode-bound

Throughput (`throughput` in the JSON: one entry per `--batch` size and `--kernels` variant, run one after the other
in one process; the top level repeats the first entry's figures): the same model
(our weights copied into `transformers.LlamaForCausalLM`; our parameter names follow HF Llama; `max_seq_len` =
prompt_len + new_tokens), the same prompts (equal length, no padding), greedy, exactly `new_tokens` tokens each (no
stop tokens). One engine per batch size (`max_running_requests` = the batch), warmed by a 3-token run of the whole
batch (which captures its CUDA graphs: the decode graph and the prefill graph of this prompt length), then timed
`--repeats` times with nothing left to capture, as a rollout worker keeps its engine across RL steps. Per batch:

- `prefill_s`: every request added and admitted (`engine.admit()`: one prefill per request, sampling its first token);
- `ms_per_decode_step`: the `engine.step()` loop until no work is left, per step (`decode_steps` = new_tokens - 1);
- `native_s`: both; `native_tokens_per_s` = batch x new_tokens / native_s. Each is the median of the repeats.

Kernels (`kernels`): `fused` is packed q/k/v and gate/up GEMMs with elementwise stages compiled by torch.compile
(`tidal.engine.generation.fused`) and torch's SDPA for decode attention, `eager` the same engine launching torch's
own kernels; `triton` is `fused` with the Triton decode attention (`EngineConfig.decode_attention`), `overlap` is
`triton` with each step launched before the previous one is read back (`EngineConfig.overlap`) and decode rows
compacted to the active requests (`EngineConfig.compact_rows`); `gemm` is `overlap` with the projections on the
engine's Triton GEMMs, the SiLU product, residual adds and norms fused in (`EngineConfig.decode_gemm`): the CUDA
engine's default; `full` is `overlap` computing a row for every slot. Every variant but `gemm` and `slots` runs
cuBLAS GEMMs. `speedup_vs_eager` = eager ms per step / the variant's ms per step at the same
batch, measured side by side. HF `generate` runs once per batch, beside the first variant.
`decode_profile.top_kernels`: the kernels with the most device time per step.

Memory-bandwidth bound: `copy_bandwidth_GBps` is a device-to-device copy (`dst.copy_(src)` of a 2 GiB bf16 tensor,
CUDA events, median of 20 after warm-up; bytes read + bytes written; on CPU 256 MiB fp32 on one thread, wall
clock). A decode step must read every weight once (`weight_bytes`: every parameter in the compute dtype, a tied
embedding once) and the KV of every valid position: at generated position j, batch x (prompt_len + j) x 2 (K, V) x
layers x kv_heads x head_dim x dtype bytes, averaged over j = 1 .. new_tokens - 1 (`mean_kv_bytes_per_step`).
`bound_ms_per_step` = (weight_bytes + mean_kv_bytes_per_step) / copy bandwidth and `bound_ratio` =
bound_ms_per_step / ms_per_decode_step (1: at the bound; masked key positions an attention call reads past the valid
ones count against it). Goals: `bound_ratio` >= 0.5 at batch 64 and `speedup_vs_hf` >= 2.

KV memory (`--kv-budget-gib G`): each engine gets G GiB of KV blocks (`kv_cache_bytes`); requests hold blocks as
their tokens need them and the newest is preempted (re-prefilled later) when none is free (`preemptions_per_run`).
The `slots` variant runs the same budget with `max_running_requests` cut to the requests a cache of one
`max_seq_len` slot per request holds in it: the concurrency the budget bought before the cache was paged.

`first_run_s`: the warm-up run of the new engine (its CUDA graph captures included), as an engine rebuilt every step
pays it. `--tail-mean M`: lengths with an RL rollout's long tail (geometric, mean M, capped at `--new-tokens`,
the same for every variant): the GRPO step's rollout phase without the driver. `--host-profile`: the engine loop's
Python, the functions with the most own time in one more run (`host_profile`).

HF `generate` (`hf_s`, `hf_tokens_per_s`: the whole call, prefill included, median of the repeats) runs for every
batch up to 64; a larger one only with `--hf-all` (else `hf_tokens_per_s` is null and `hf_note` says why). If
transformers is missing (our CPU machines) the HF part is skipped the same way. `hf_first_token_agreement` checks
the weight mapping: the share of requests whose greedy first token matches (later ones may drift in bf16).

Migration (`--no-migration` skips it): one request with `context - 8` prompt tokens and 8 generated tokens on engine
A, moved to engine B on the same device. `kv_move_s`: export_state + import_state + admission (KV written into B's
slot), in process; `kv_move_wire_s` adds the cross-process wire format (safetensors bytes to host and back).
`reprefill_s`: the fallback path, export without KV + import + admission with a one-pass re-prefill of the whole
context (the cheapest re-prefill, so the ratio is conservative; the exact native "replay" mode adds 7 decode steps).
`ratio` = kv_move_s / reprefill_s (goal <= 0.2). Each number is the median of `--repeats` runs.

Attention probe (CUDA only, `--no-probe` skips it; `attention` in the JSON): the engine's decode attention call
(`decode_attention`, the first batch's rows over the mean decode context's key bucket, additive mask) timed with
CUDA events under torch's default choice and each SDPA backend that accepts it, beside `kv_read_bound_us`, the
time to read its K and V once at the measured copy bandwidth; and the fused engine's Triton kernel
(`decode_attention_fused`: each row reads only its visible keys) beside `visible_kv_read_bound_us`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time

import torch

from tidal.core.provenance import commit
from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.generation.migration import states_from_bytes, states_to_bytes
from tidal.engine.model import ModelArgs, Transformer, init_global_weights
from tidal.engine.shapes import padded_len

GPU_MODEL = dict(vocab_size=32000, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                 intermediate_size=2816)
#: the Qwen2.5-1.5B shape (tied embeddings, vocab 151,936): `--model qwen2.5-1.5b`
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                   intermediate_size=8960, tie_embeddings=True, rope_theta=1e6)
CPU_MODEL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
HF_MAX_BATCH = 64  # larger batches run HF `generate` only with --hf-all


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def build(model_kw, max_seq_len, device, dtype):
    args = ModelArgs(max_seq_len=max_seq_len, **model_kw)
    weights = init_global_weights(args, 0)
    m = Transformer(args, dtype=dtype, device=device)
    m.load_global(weights)
    return args, m, weights


def prompts(args, batch, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, args.vocab_size, (batch, length), generator=g)


def tail_lengths(batch: int, new_tokens: int, mean: float, seed: int = 0) -> list[int]:
    """Response lengths with an RL rollout's long tail: geometric with this mean (>= 2), capped at new_tokens,
    seeded (the same lengths for every variant)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64)
    geo = torch.ceil(torch.log1p(-u) / torch.log1p(torch.tensor(-1.0 / mean, dtype=torch.float64)))
    return [int(min(new_tokens, max(2, n))) for n in geo.tolist()]


def native_generate(engine: NativeEngine, ids_BT: torch.Tensor, new_tokens: int, tag: str, temperature: float = 0.0,
                    lengths: list[int] | None = None):
    """Admission (prefill) and the decode loop of one batch, timed apart: ({prefill_s, decode_s, decode_steps},
    tokens per request). `lengths`: each request's own max_new_tokens (else `new_tokens` each)."""
    out: dict[str, tuple[int, ...]] = {}

    def collect(events):
        for ev in events:
            if ev.finished:
                out[ev.request_id] = ev.result.token_ids

    sync(engine.device)
    t0 = time.perf_counter()
    for i, row in enumerate(ids_BT.tolist()):
        params = SamplingParams(temperature=temperature, max_new_tokens=lengths[i] if lengths else new_tokens)
        engine.add(Request(f"{tag}-{i}", tuple(row), params, seed=i))
    while engine.num_waiting():   # a KV budget may admit fewer: the rest wait for blocks during decode
        before = engine.num_waiting()
        collect(engine.admit())
        if engine.num_waiting() == before:
            break
    sync(engine.device)
    t1 = time.perf_counter()
    steps, window, mark, profile = 0, 128, t1, []
    prompt_len = ids_BT.shape[1]
    while engine.has_work():
        collect(engine.step())   # each step reads its sampled tokens back: the host clock follows the device
        steps += 1
        if steps % window == 0:   # (context tokens at the window's middle, ms per step): the cost model's fit
            now = time.perf_counter()
            profile.append((prompt_len + steps - window // 2, (now - mark) / window * 1e3))
            mark = now
    sync(engine.device)
    timing = {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "decode_steps": steps,
              "ms_per_step_by_context": profile}
    return timing, [out[f"{tag}-{i}"] for i in range(ids_BT.shape[0])]


def decode_profile(engine: NativeEngine, ids_BT: torch.Tensor, new_tokens: int, steps: int = 32,
                   temperature: float = 0.0) -> dict:
    """Where a decode step's time goes (CUDA): `steps` steps mid-generation under torch.profiler, the kernels
    launched per step and their summed device time, against the wall time per step; the rest is the host's
    share (Python, launches, the per-step read-back of sampled tokens) while the device waits."""
    from torch.profiler import ProfilerActivity, profile
    params = SamplingParams(temperature=temperature, max_new_tokens=new_tokens)
    for i, row in enumerate(ids_BT.tolist()):
        engine.add(Request(f"prof-{i}", tuple(row), params, seed=i))
    while engine.num_waiting():
        engine.admit()
    for _ in range(new_tokens // 2):
        engine.step()
    sync(engine.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync(engine.device)
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    def device_us(e) -> float:
        return e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total

    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(device_us(e))
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    while engine.has_work():
        engine.step()
    return {"steps": steps, "kernels_per_step": len(kernels) / steps,
            "device_busy_ms_per_step": sum(map(device_us, kernels)) / steps / 1e3,
            "wall_ms_per_step_profiled": wall / steps * 1e3,
            "top_kernels": [{"name": name[:120], "per_step": len(t) / steps, "us_per_step": sum(t) / steps}
                            for name, t in top]}


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + bytes written (see module doc)."""
    cuda = device.type == "cuda"
    dtype, nbytes, reps = (torch.bfloat16, 2 << 30, 20) if cuda else (torch.float32, 256 << 20, 5)
    src = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    seconds = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(seconds) / 1e9


def mean_kv_bytes_per_step(args: ModelArgs, batch: int, prompt_len: int, new_tokens: int, dtype) -> float:
    """Valid K + V bytes a decode step reads, averaged over the steps at generated positions 1 .. new_tokens - 1."""
    per_position = 2 * args.num_layers * args.num_kv_heads * args.head_dim * dtype.itemsize
    steps = range(1, new_tokens)
    return batch * per_position * sum(prompt_len + j for j in steps) / max(1, len(steps))


def hf_model(args, weights, device, dtype):
    import transformers  # only on machines that have it
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps,
                      rope_theta=args.rope_theta, tie_word_embeddings=args.tie_embeddings, attention_bias=False,
                      mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if getattr(cfg, "rope_parameters", None) is not None:  # transformers 5 keeps rope settings here
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": args.rope_theta}
    hf = LlamaForCausalLM(cfg)
    state = {(k if k == "lm_head.weight" else f"model.{k}"): v for k, v in weights.items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # a tied head has no tensor of its own (it is the embedding): transformers lists it as missing
    missing = [k for k in missing if "rotary" not in k and not (args.tie_embeddings and k == "lm_head.weight")]
    if args.tie_embeddings:
        hf.tie_weights()
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return hf.to(device=device, dtype=dtype).eval(), transformers.__version__


@torch.no_grad()
def hf_generate(hf, ids_BT, new_tokens, device):
    ids = ids_BT.to(device)
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def throughput(a, device, dtype, report):
    bandwidth = copy_bandwidth(device)
    args, m, weights = build(a.model, a.prompt_len + a.new_tokens, device, dtype)
    weight_bytes = sum(p.numel() for p in m.parameters()) * dtype.itemsize  # parameters() yields a tied one once
    report.update(copy_bandwidth_GBps=bandwidth, weight_bytes=weight_bytes)
    hf, hf_note = None, None
    if a.tail_mean and not a.no_hf:
        hf_note = "--tail-mean: HF generate is compared at equal lengths only"
    elif a.temperature > 0 and not a.no_hf:
        hf_note = f"--temperature {a.temperature}: HF generate is compared greedy only"
    elif not a.no_hf and (a.hf_all or min(a.batches) <= HF_MAX_BATCH):
        try:
            hf, report["hf_version"] = hf_model(args, weights, device, dtype)
        except ImportError:
            hf_note = "transformers is not installed: HF comparison skipped"
    rows = []
    for batch, kernels in ((b, k) for b in a.batches for k in a.kernels):
        ids = prompts(args, batch, a.prompt_len)
        lengths = tail_lengths(batch, a.new_tokens, a.tail_mean) if a.tail_mean else None
        budget = int(a.kv_budget_gib * 2**30) if a.kv_budget_gib else None
        running = batch if kernels != "slots" else slot_equivalent(args, budget, batch, dtype)
        engine = NativeEngine(m, EngineConfig(max_running_requests=running, fused_kernels=kernels != "eager",
                                              kv_budget_bytes=budget,
                                              decode_attention="triton" if kernels in ("triton", "overlap", "full",
                                                                                       "gemm", "slots") else "sdpa",
                                              overlap=kernels in ("overlap", "full", "gemm", "slots"),
                                              compact_rows=False if kernels == "full" else None,
                                              decode_gemm=("triton" if kernels == "gemm" else
                                                           None if kernels == "slots" else "cublas")))
        preempted = engine.preemptions
        # a whole warm-up run: it captures every CUDA graph the timed runs replay (one per decode key span)
        t_warm = time.perf_counter()
        native_generate(engine, ids, a.new_tokens, "warm", a.temperature, lengths)
        first_run_s = time.perf_counter() - t_warm   # a new engine's first run: its graph captures included
        runs, tokens = [], None
        for rep in range(a.repeats):
            timing, tokens = native_generate(engine, ids, a.new_tokens, f"r{rep}", a.temperature, lengths)
            runs.append(timing)
        host = None
        if a.host_profile:   # where the host's time goes in one more run (cProfile: the engine loop's Python)
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            native_generate(engine, ids, a.new_tokens, "prof", a.temperature, lengths)
            prof.disable()
            st = pstats.Stats(prof)
            top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:12]   # by own (total internal) time
            host = [{"fn": f"{k[0].rsplit('/', 1)[-1]}:{k[1]}:{k[2]}", "own_s": v[2], "calls": v[1]} for k, v in top]
        preempted = (engine.preemptions - preempted) / (a.repeats + 1)   # per run (warm-up included)
        profile = (decode_profile(engine, ids, a.new_tokens, temperature=a.temperature)
                   if device.type == "cuda" and a.profile_steps else None)
        kv_cache_bytes = engine.cache.nbytes
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
        prefill_s, decode_s = (statistics.median(r[k] for r in runs) for k in ("prefill_s", "decode_s"))
        native_s = statistics.median(r["prefill_s"] + r["decode_s"] for r in runs)
        steps = runs[0]["decode_steps"]
        ms_per_step = decode_s / steps * 1e3
        kv_bytes = mean_kv_bytes_per_step(args, batch, a.prompt_len, a.new_tokens, dtype)
        bound_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
        tokens_out = sum(lengths) if lengths else batch * a.new_tokens
        row = {"batch": batch, "kernels": kernels, "prefill_s": prefill_s, "decode_s": decode_s, "decode_steps": steps,
               "ms_per_decode_step": ms_per_step, "native_s": native_s,
               "native_tokens_per_s": tokens_out / native_s, "mean_kv_bytes_per_step": kv_bytes,
               "bound_ms_per_step": bound_ms, "bound_ratio": bound_ms / ms_per_step if not lengths else None,
               "ms_per_step_by_context": runs[-1]["ms_per_step_by_context"], "decode_profile": profile,
               "response_tokens": tokens_out, "host_profile": host, "first_run_s": first_run_s,
               "max_running_requests": running, "kv_budget_bytes": budget, "kv_cache_bytes": kv_cache_bytes,
               "preemptions_per_run": preempted}
        rows.append(row)
        if kernels != a.kernels[0] or hf is None or (batch > HF_MAX_BATCH and not a.hf_all):
            row.update(hf_tokens_per_s=None, speedup_vs_hf=None,
                       hf_note=hf_note or ("--no-hf: HF generate skipped" if a.no_hf else
                                           f"batch above {HF_MAX_BATCH}: HF generate skipped (--hf-all runs it)"))
        else:
            hf_generate(hf, ids[: min(4, batch)], 4, device)  # warm-up
            times = []
            for _ in range(a.repeats):
                t, hf_tokens = hf_generate(hf, ids, a.new_tokens, device)
                times.append(t)
            row["hf_s"] = statistics.median(times)
            row["hf_tokens_per_s"] = batch * a.new_tokens / row["hf_s"]
            row["speedup_vs_hf"] = row["native_tokens_per_s"] / row["hf_tokens_per_s"]
            row["hf_first_token_agreement"] = sum(x[0] == y[0] for x, y in zip(tokens, hf_tokens)) / batch
        print(f"batch {batch} ({kernels} kernels): {row['native_tokens_per_s']:.0f} tokens/s, "
              f"prefill {prefill_s:.2f} s, "
              f"{ms_per_step:.2f} ms/decode step"
              + (f" (bound {bound_ms:.2f} ms, ratio {row['bound_ratio']:.2f})" if row["bound_ratio"] else "")
              + (f", {row['speedup_vs_hf']:.2f}x HF generate" if row["speedup_vs_hf"] else "")
              + (f", {steps} steps for {tokens_out} tokens" if lengths else ""), flush=True)
    del hf
    for r in rows:
        eager = next((e for e in rows if e["batch"] == r["batch"] and e["kernels"] == "eager"), None)
        if r["kernels"] != "eager" and eager is not None:
            r["speedup_vs_eager"] = eager["ms_per_decode_step"] / r["ms_per_decode_step"]
    report["throughput"] = rows
    first = rows[0]  # the top-level keys of a single-batch run
    report.update({k: first[k] for k in ("kernels", "ms_per_decode_step", "bound_ratio", "speedup_vs_eager",
                                         "native_s", "native_tokens_per_s", "hf_s", "hf_tokens_per_s",
                                         "speedup_vs_hf", "hf_first_token_agreement", "hf_note") if k in first})


def timed_move(model: Transformer, prompt: tuple[int, ...], mode: str, device, generated: int = 8) -> float:
    """Seconds to move one request (`prompt`, `generated` tokens so far) from one engine to another on `device`,
    from the export to the target's admission: `kv` (its KV copied in process), `wire` (the states through their
    safetensors bytes), `reprefill` (no KV: a one-pass re-prefill at admission). Eager engines: a fresh engine
    would capture a new prefill graph inside the timed region."""
    src = NativeEngine(model, EngineConfig(2, cuda_graph=False))
    dst = NativeEngine(model, EngineConfig(2, reprefill="single_pass", cuda_graph=False))
    src.add(Request("x", prompt, SamplingParams(temperature=1.0, max_new_tokens=64), seed=1))
    for _ in range(generated - 1):  # step 1: prefill samples a token and decode samples one more
        src.step()
    sync(device)
    t0 = time.perf_counter()
    states = src.export_state(["x"])
    if mode == "reprefill":
        states = [st.without_kv() for st in states]
    if mode == "wire":
        states = states_from_bytes(states_to_bytes(states), device)
    dst.import_state(states, staged=True)
    src.commit_export(["x"])
    dst.activate(["x"])
    dst.admit()
    sync(device)
    seconds = time.perf_counter() - t0
    assert len(states[0].token_ids) == generated
    return seconds


def migration(a, device, dtype, report):
    generated = 8
    args, m, _ = build(a.model, max(a.contexts) + 64, device, dtype)
    rows = []
    for ctx in a.contexts:
        prompt = tuple(prompts(args, 1, ctx - generated, seed=ctx)[0].tolist())
        res: dict[str, list[float]] = {"kv": [], "wire": [], "reprefill": []}
        for rep in range(a.repeats + 1):  # the first round warms up
            for mode in res:
                seconds = timed_move(m, prompt, mode, device, generated)
                if rep:
                    res[mode].append(seconds)
        kv, wire, rp = (statistics.median(res[k]) for k in ("kv", "wire", "reprefill"))
        rows.append({"context_tokens": ctx, "kv_move_s": kv, "kv_move_wire_s": wire, "reprefill_s": rp,
                     "ratio": kv / rp, "ratio_wire": wire / rp})
    report["migration"] = rows


def attention_probe(a, device, dtype, report):
    """The engine's decode attention call (`decode_attention`: GQA folded into query rows, the additive mask it
    builds once per step) at the first batch and the mean decode context, under each SDPA backend that takes it,
    against the time to read its K and V once at the measured copy bandwidth."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tidal.engine.generation.decode_attention import decode_attention_fused
    from tidal.engine.generation.kv_cache import decode_attention
    m = a.model
    heads, kv, d = m["num_heads"], m["num_kv_heads"], m["hidden_size"] // m["num_heads"]
    rows = a.batches[0]
    span = padded_len(a.prompt_len + a.new_tokens // 2)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, heads, 1, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(rows, kv, span, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(rows, kv, span, d, device=device, dtype=dtype, generator=g)
    lengths = torch.randint(span // 2, span, (rows, 1), device=device, generator=g)
    visible = (torch.arange(span, device=device)[None, :] < lengths)[:, None, None, :]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))

    def timed(fn, n=200):
        for _ in range(10):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n * 1e3  # microseconds per call

    ref = decode_attention(q, k, v, mask).float()
    backends: dict[str, dict] = {"default": {"us": timed(lambda: decode_attention(q, k, v, mask))}}
    for name in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "MATH"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                out = decode_attention(q, k, v, mask).float()
                backends[name] = {"us": timed(lambda: decode_attention(q, k, v, mask)),
                                  "rel_diff": ((out - ref).norm() / ref.norm()).item()}
        except RuntimeError as e:
            backends[name] = {"refused": str(e).splitlines()[0][:160]}
    # the fused engine's kernel: each row reads its own keys 0..pos (pos = its last visible key), the new K/V at
    # pos given as the cache's own (so the cache is unchanged between calls)
    pos, slots = lengths[:, 0] - 1, torch.arange(rows, device=device)
    k_new, v_new = k[slots, :, pos], v[slots, :, pos]

    def triton_call():
        return decode_attention_fused(q[:, :, 0], k_new, v_new, k, v, slots, pos, span)

    out = triton_call()[:, :, None].float()
    backends["triton_split_k"] = {"us": timed(triton_call), "rel_diff": ((out - ref).norm() / ref.norm()).item()}
    bandwidth = copy_bandwidth(device) * 1e9
    kv_bytes = 2 * k.numel() * k.element_size()
    visible_bytes = kv_bytes * lengths.sum().item() / (rows * span)
    report["attention"] = {"shape": f"q {rows}x{heads}x1x{d}, kv {rows}x{kv}x{span}x{d}, additive mask",
                           "kv_read_bound_us": kv_bytes / bandwidth * 1e6,
                           "visible_kv_read_bound_us": visible_bytes / bandwidth * 1e6,
                           "backends": backends}


def machine(device):
    info = f"{platform.node()} {platform.machine()} torch {torch.__version__} threads {torch.get_num_threads()}"
    if device.type == "cuda":
        info += f" {torch.cuda.get_device_name(device)}"
    return info


def batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of batch sizes (e.g. 64,256)") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every batch size must be >= 1")
    return out


def kernel_variants(text: str) -> list[str]:
    out = text.split(",")
    if not out or any(k not in ("fused", "triton", "overlap", "full", "gemm", "eager", "slots") for k in out):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of fused, triton, overlap, full, gemm, eager, "
                                         f"slots")
    return out


def slot_equivalent(args, budget: int | None, batch: int, dtype) -> int:
    """Requests a cache of one `max_seq_len` slot per request would run in `budget` bytes (the `slots` variant's
    max_running_requests: what paging is measured against)."""
    if budget is None:
        raise SystemExit("--kernels slots needs --kv-budget-gib (the budget whose slot count it runs)")
    slot = 2 * args.num_layers * args.num_kv_heads * args.max_seq_len * args.head_dim * dtype.itemsize
    return max(1, min(batch, budget // slot))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model and batch (CPU smoke run, < 2 min)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--batch", type=batches, default=None, metavar="B[,B...]",
                   help="decode batch sizes, each run in turn (default 64 on GPU, 8 on CPU)")
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None, help=">= 2 (the prefill samples the first token)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--model", choices=("default", "qwen2.5-1.5b"), default="default",
                   help="default: a 16-layer 1024-wide model on GPU (the tiny one with --quick or on CPU)")
    p.add_argument("--profile-steps", type=int, default=32,
                   help="CUDA: profile this many decode steps per batch (kernels, device-busy time); 0 skips it")
    p.add_argument("--no-hf", action="store_true", help="skip HF generate (the native engine's figures only)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (each request its own seeded generator, no stop tokens: still "
                        "exactly --new-tokens each, as RL rollouts draw them); 0: greedy. HF generate is compared "
                        "only greedy")
    p.add_argument("--hf-all", action="store_true", help=f"run HF generate for batches above {HF_MAX_BATCH} too")
    p.add_argument("--no-migration", action="store_true", help="skip the migration section")
    p.add_argument("--no-probe", action="store_true", help="skip the attention probe (CUDA)")
    p.add_argument("--kernels", type=kernel_variants, default=None, metavar="K[,K...]",
                   help="engine kernels to time side by side: fused (packed GEMMs, compiled elementwise stages; "
                        "CUDA with Triton), triton (fused + the Triton decode attention), overlap (triton + "
                        "overlapped decode, compact rows), gemm (overlap with the Triton decode GEMMs: the CUDA "
                        "default), full (overlap computing a row for every slot, `compact_rows` off), slots (the "
                        "default kernels running only the requests a cache of one max_seq_len slot per request holds "
                        "in --kv-budget-gib) and/or eager (default: fused,eager "
                        "on CUDA, eager on CPU)")
    p.add_argument("--kv-budget-gib", type=float, default=None,
                   help="KV memory of each engine (`EngineConfig.kv_budget_bytes`): requests hold blocks as their "
                        "tokens need them, the newest preempted when none is free (default: every request at "
                        "max_seq_len)")
    p.add_argument("--tail-mean", type=float, default=None,
                   help="each request's length drawn from a geometric distribution of this mean, capped at "
                        "--new-tokens (an RL rollout's long tail: most slots free while the longest finish); "
                        "tokens/s then counts the tokens generated and bound_ratio is null")
    p.add_argument("--host-profile", action="store_true",
                   help="profile one more run's host side (cProfile): the functions with the most own time")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    a.model = QWEN25_1_5B if a.model == "qwen2.5-1.5b" else GPU_MODEL if gpu and not a.quick else CPU_MODEL
    a.batches = a.batch or [8 if a.quick or not gpu else 64]
    a.kernels = a.kernels or (["fused", "eager"] if gpu else ["eager"])
    a.prompt_len = a.prompt_len or (16 if a.quick else 128)
    a.new_tokens = a.new_tokens or (32 if a.quick else 256)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.contexts = [512, 2048, 4096]
    if a.new_tokens < 2:
        p.error("--new-tokens must be >= 2: decode steps are timed, and the prefill samples the first token")
    torch.set_num_threads(torch.get_num_threads() if gpu else 1)  # CPU: one thread, like our workers
    report = {"name": "rollout", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "machine": machine(device), "device": str(device), "dtype": str(dtype),
              "command": shlex.join(["python", "benchmarks/rollout.py", *(sys.argv[1:] if argv is None else argv)]),
              "model": a.model, "batch": a.batches[0], "batches": a.batches, "prompt_len": a.prompt_len,
              "new_tokens": a.new_tokens, "repeats": a.repeats, "temperature": a.temperature}
    if gpu and not a.no_probe:
        try:
            attention_probe(a, device, dtype, report)
        except Exception as e:  # a diagnostic: never lose the throughput numbers to it
            report["attention"] = {"error": f"{type(e).__name__}: {e}"}
    throughput(a, device, dtype, report)
    if not a.no_migration:
        migration(a, device, dtype, report)
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
