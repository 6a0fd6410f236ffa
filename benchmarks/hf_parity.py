"""A full-size Hugging Face checkpoint through `model.path`: Tidal's model against `transformers` on one GPU.

    python benchmarks/hf_parity.py --json out.json                 # GPU: Qwen2.5-1.5B's real config, random weights
    python benchmarks/hf_parity.py --family qwen3-0.6b --json out.json   # Qwen3-0.6B's (q/k norms, head_dim 128)
    python benchmarks/hf_parity.py --quick --json out.json         # CPU: the same config shrunk (CI-sized)

The checkpoint is written by `transformers` itself (`from_config` with Qwen2.5-1.5B-Instruct's config.json values:
vocab 151,936, hidden 1,536, 28 layers, 12 heads, 2 KV heads, intermediate 8,960, tied embeddings, q/k/v biases,
rope_theta 1e6; random weights as transformers initialises them, q/k/v biases drawn too) and saved in bf16 with
`save_pretrained` (sharded past --shard). Tidal loads it as `model.path` does (`read_hf_config` + `load_hf_weights`:
fp32 masters), then runs in the compared dtype.

Measured, same prompts, same device, in one process:
  - per-token log-probs of `--batch` random sequences of `--seq` tokens (log_softmax of the logits, fp32), max and
    mean |difference|: Tidal against transformers in the same dtype (fp32, bf16), and in bf16 each of them against
    transformers in fp32 (the bf16 error of Tidal beside the bf16 error of transformers itself);
  - 64 greedy tokens from Tidal's native engine (KV cache, CUDA graphs on GPU) against `generate` (greedy), in fp32
    and in bf16: tokens equal, and the first position where they differ. With random weights the next-token
    distribution is nearly flat, so in bf16 a near-tie can flip the argmax: the fp32 comparison is the exact one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from tidal.core.provenance import commit
from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.hf_checkpoint import load_hf_weights, read_hf_config, weight_files
from tidal.engine.model import Transformer

# Qwen2.5-1.5B-Instruct's config.json (the values that shape the model)
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                   num_key_value_heads=2, intermediate_size=8960, max_position_embeddings=32768,
                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
                   eos_token_id=151645, sliding_window=32768, use_sliding_window=False, max_window_layers=21)
# Qwen3-0.6B's config.json (q/k norms, explicit head_dim 128 with hidden 1,024 / 16 heads)
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False,
                  bos_token_id=151643, eos_token_id=151645)
QUICK = dict(QWEN25_1_5B, vocab_size=2048, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=256, bos_token_id=0, eos_token_id=1)


FAMILIES = {"qwen2.5-1.5b": ("Qwen2Config", "Qwen2ForCausalLM", QWEN25_1_5B),
            "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", QWEN3_0_6B)}


def make_checkpoint(path: Path, family: str, config: dict, device: str, shard: str) -> float:
    import transformers
    cls, arch, _ = FAMILIES[family]
    cfg = getattr(transformers, cls)(**config)
    cfg.architectures = [arch]
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():   # biases are zero-initialised: draw them so a dropped bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    t0 = time.perf_counter()
    model.save_pretrained(str(path), max_shard_size=shard)
    del model
    return time.perf_counter() - t0


def logprobs(model, ids: torch.Tensor, ours: bool) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) in fp32 (of the model's logits in its own dtype)."""
    with torch.no_grad():
        if ours:
            return model.token_logprobs(ids).float()
        logits = model(ids).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"max": d.max().item(), "mean": d.mean().item()}


def greedy_compare(ours: Transformer, ref, prompt: list[int], n: int) -> dict:
    engine = NativeEngine(ours, EngineConfig(max_running_requests=1))
    engine.add(Request("g", tuple(prompt), SamplingParams(0.0, max_new_tokens=n), seed=0))
    mine: list[int] = []
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                mine = list(ev.result.token_ids)
    x = torch.tensor([prompt], device=next(ref.parameters()).device)
    with torch.no_grad():
        theirs = ref.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
    return {"greedy_tokens": n, "greedy_equal": mine == theirs, "greedy_first_difference": first}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shrunk config on CPU")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="qwen2.5-1.5b")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--greedy", type=int, default=64)
    ap.add_argument("--shard", default="2GB", help="save_pretrained's max_shard_size (sharded with an index)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    import transformers
    device = args.device or ("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    config = QUICK if args.quick else FAMILIES[args.family][2]
    out = {"name": "hf_parity", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
           "commit": commit(), "machine": f"{platform.machine()} torch {torch.__version__} "
           f"threads {torch.get_num_threads()} " + (torch.cuda.get_device_name() if device == "cuda" else "cpu"),
           "transformers": transformers.__version__, "device": device, "family": args.family, "config": config,
           "seq": args.seq, "batch": args.batch}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{args.family}-random"
        out["save_s"] = make_checkpoint(path, args.family if not args.quick else "qwen2.5-1.5b", config, device,
                                        args.shard)
        out["files"] = [p.name for p in weight_files(path)]
        t0 = time.perf_counter()
        hf = read_hf_config(path, args.seq + args.greedy + 16)
        weights = load_hf_weights(hf)
        out["load_s"] = time.perf_counter() - t0
        out.update(architecture=hf.architecture, num_params=hf.num_params, dtype_on_disk=hf.dtype)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, config["vocab_size"], (args.batch, args.seq), generator=g).to(device)
        prompt = ids[0, :32].tolist()
        truth = None   # transformers in fp32: the reference every figure is measured against
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            ours = Transformer(hf.args, dtype=dtype, device=device)
            ours.load_global(weights)
            ours.eval()
            ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
            lp_ours, lp_ref = logprobs(ours, ids, True), logprobs(ref, ids, False)
            truth = lp_ref if truth is None else truth
            out[name] = {"logprob_ours_vs_transformers": diff(lp_ours, lp_ref),
                         "logprob_ours_vs_fp32_transformers": diff(lp_ours, truth),
                         "logprob_transformers_vs_fp32_transformers": diff(lp_ref, truth),
                         **greedy_compare(ours, ref, prompt, args.greedy)}
            print(name, out[name], flush=True)
            del ours, ref
            if device == "cuda":
                torch.cuda.empty_cache()
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
