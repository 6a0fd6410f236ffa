"""Rollout benchmark: native engine tokens/s vs Hugging Face `generate`, and migration cost (KV move vs re-prefill).

    python benchmarks/rollout.py --quick --json out.json            # CPU, tiny model, < 2 min
    python benchmarks/rollout.py --device cuda --json out.json      # GPU: 16-layer model, batch 64

Throughput: the same model (our weights copied into `transformers.LlamaForCausalLM`; our parameter names follow
HF Llama), the same prompts (equal length, no padding), the same batch, greedy, exactly `new_tokens` tokens each
(no stop tokens), in the same process. Time includes prefill (and, for the native engine on CUDA, capturing its
CUDA graphs: one decode graph and one prefill graph per prompt length, per engine). If transformers is missing (our CPU
machines) the HF part is skipped with a note and `hf_tokens_per_s` is null.

Migration: one request with `context - 8` prompt tokens and 8 generated tokens on engine A, moved to engine B on
the same device. `kv_move_s`: export_state + import_state + admission (KV written into B's slot), in process;
`kv_move_wire_s` adds the cross-process wire format (safetensors bytes to host and back). `reprefill_s`: the
fallback path, export without KV + import + admission with a one-pass re-prefill of the whole context (the
cheapest re-prefill, so the ratio is conservative; the exact native "replay" mode adds 7 decode steps).
`ratio` = kv_move_s / reprefill_s (goal <= 0.2). Each number is the median of `--repeats` runs.

Attention probe (CUDA only, `attention` in the JSON): one decode-shaped attention call of this model (batch rows x
heads x 1 query over the full `max_seq_len` slot, boolean mask) timed with CUDA events, as the engine calls it
(`enable_gqa=True`) and with the KV heads expanded first (`repeat_interleave`, the CPU path); and which SDPA
backends accept the fused GQA + mask call (a backend that refuses it leaves the math fallback).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time

import torch

from tidal.core.provenance import commit
from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.generation.migration import states_from_bytes, states_to_bytes
from tidal.engine.model import ModelArgs, Transformer, init_global_weights

GPU_MODEL = dict(vocab_size=32000, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                 intermediate_size=2816)
#: the Qwen2.5-1.5B shape (tied embeddings, vocab 151,936): `--model qwen2.5-1.5b`
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                   intermediate_size=8960, tie_embeddings=True, rope_theta=1e6)
CPU_MODEL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


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


def native_generate(m, ids_BT, new_tokens):
    engine = NativeEngine(m, EngineConfig(max_running_requests=ids_BT.shape[0]))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    sync(engine.device)
    t0 = time.perf_counter()
    for i, row in enumerate(ids_BT.tolist()):
        engine.add(Request(f"b{i}", tuple(row), params, seed=i))
    out = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                out[ev.request_id] = ev.result.token_ids
    sync(engine.device)
    return time.perf_counter() - t0, [out[f"b{i}"] for i in range(ids_BT.shape[0])]


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
    args, m, weights = build(a.model, a.prompt_len + a.new_tokens, device, dtype)
    ids = prompts(args, a.batch, a.prompt_len)
    native_generate(m, ids[: min(4, a.batch)], 4)  # warm-up (allocator, kernels)
    times, tokens = [], None
    for _ in range(a.repeats):
        t, tokens = native_generate(m, ids, a.new_tokens)
        times.append(t)
    report["native_s"] = statistics.median(times)
    report["native_tokens_per_s"] = a.batch * a.new_tokens / report["native_s"]
    try:
        hf, version = hf_model(args, weights, device, dtype)
    except ImportError:
        report.update(hf_tokens_per_s=None, speedup_vs_hf=None,
                      hf_note="transformers is not installed: HF comparison skipped")
        return
    hf_generate(hf, ids[: min(4, a.batch)], 4, device)
    times = []
    for _ in range(a.repeats):
        t, hf_tokens = hf_generate(hf, ids, a.new_tokens, device)
        times.append(t)
    report["hf_s"] = statistics.median(times)
    report["hf_tokens_per_s"] = a.batch * a.new_tokens / report["hf_s"]
    report["speedup_vs_hf"] = report["native_tokens_per_s"] / report["hf_tokens_per_s"]
    report["hf_version"] = version
    # sanity of the weight mapping: greedy first tokens agree (later ones may drift in bf16)
    report["hf_first_token_agreement"] = sum(x[0] == y[0] for x, y in zip(tokens, hf_tokens)) / a.batch
    del hf


def migration(a, device, dtype, report):
    generated = 8
    args, m, _ = build(a.model, max(a.contexts) + 64, device, dtype)
    rows = []
    for ctx in a.contexts:
        prompt = tuple(prompts(args, 1, ctx - generated, seed=ctx)[0].tolist())
        params = SamplingParams(temperature=1.0, max_new_tokens=64)
        res = {"kv": [], "wire": [], "reprefill": []}
        for rep in range(a.repeats + 1):  # the first round warms up
            for mode in res:
                # eager engines: a fresh engine would capture a new prefill graph inside the timed region
                src = NativeEngine(m, EngineConfig(2, cuda_graph=False))
                dst = NativeEngine(m, EngineConfig(2, reprefill="single_pass", cuda_graph=False))
                src.add(Request("x", prompt, params, seed=1))
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
                if rep:
                    res[mode].append(time.perf_counter() - t0)
                assert len(states[0].token_ids) == generated
                del src, dst
        kv, wire, rp = (statistics.median(res[k]) for k in ("kv", "wire", "reprefill"))
        rows.append({"context_tokens": ctx, "kv_move_s": kv, "kv_move_wire_s": wire, "reprefill_s": rp,
                     "ratio": kv / rp, "ratio_wire": wire / rp})
    report["migration"] = rows


def attention_probe(a, device, dtype, report):
    """Decode attention per layer call: fused GQA vs expanded KV, and the SDPA backends that take the fused call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    m = a.model
    heads, kv, d = m["num_heads"], m["num_kv_heads"], m["hidden_size"] // m["num_heads"]
    s_len, rows = a.prompt_len + a.new_tokens, a.batch
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(rows, heads, 1, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(rows, kv, s_len, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(rows, kv, s_len, d, device=device, dtype=dtype, generator=g)
    mask = (torch.arange(s_len, device=device)[None, :] < torch.randint(1, s_len, (rows, 1), device=device,
                                                                         generator=g))[:, None, None, :]

    def fused():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def expanded():
        r = heads // kv
        return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1),
                                              attn_mask=mask)

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

    err = ((fused().float() - expanded().float()).norm() / expanded().float().norm()).item()
    backends = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                fused()
            backends[name] = True
        except RuntimeError:
            backends[name] = False
    fused_us = timed(fused)
    report["attention"] = {"shape": f"q {rows}x{heads}x1x{d}, kv {rows}x{kv}x{s_len}x{d}, bool mask",
                           "fused_gqa_us": fused_us, "expanded_kv_us": timed(expanded),
                           "rel_diff": err, "backends_accepting_fused_gqa_mask": backends,
                           "per_decode_step_ms_fused": fused_us * m["num_layers"] / 1e3}


def machine(device):
    info = f"{platform.node()} {platform.machine()} torch {torch.__version__} threads {torch.get_num_threads()}"
    if device.type == "cuda":
        info += f" {torch.cuda.get_device_name(device)}"
    return info


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and batch (CPU smoke run, < 2 min)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--model", choices=("default", "qwen2.5-1.5b"), default="default",
                   help="default: a 16-layer 1024-wide model on GPU (the tiny one with --quick or on CPU)")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    a.model = QWEN25_1_5B if a.model == "qwen2.5-1.5b" else GPU_MODEL if gpu and not a.quick else CPU_MODEL
    a.batch = a.batch or (8 if a.quick or not gpu else 64)
    a.prompt_len = a.prompt_len or (16 if a.quick else 128)
    a.new_tokens = a.new_tokens or (32 if a.quick else 256)
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.contexts = [512, 2048, 4096]
    torch.set_num_threads(torch.get_num_threads() if gpu else 1)  # CPU: one thread, like our workers
    report = {"name": "rollout", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "commit": commit(), "machine": machine(device), "device": str(device), "dtype": str(dtype),
              "model": a.model,
              "batch": a.batch, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens}
    if gpu:
        try:
            attention_probe(a, device, dtype, report)
        except Exception as e:  # a diagnostic: never lose the throughput numbers to it
            report["attention"] = {"error": f"{type(e).__name__}: {e}"}
    throughput(a, device, dtype, report)
    migration(a, device, dtype, report)
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
