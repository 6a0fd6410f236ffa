"""Hugging Face checkpoint directories in and out: `config.json` + `*.safetensors` <-> `ModelArgs` + fp32 weights.

    read_hf_config(dir, max_seq_len)  -> HFModel      architecture, ModelArgs, dtype on disk; strict
    load_hf_weights(dir, hf_model)    -> {name: fp32}  global tensors named as `param_specs`; strict
    save_hf(dir, weights, hf_model, dtype, tokenizer) writes a directory `transformers` and vLLM load

Families (the `architectures` entry of config.json) and what distinguishes them in `ModelArgs`:

    LlamaForCausalLM     default, `linear` or `llama3` RoPE scaling (Llama 3.1 / 3.2)
    MistralForCausalLM   as Llama; a sliding window only where it can never bind (>= the run's max_seq_len)
    Qwen2ForCausalLM     q/k/v bias (Qwen2, Qwen2.5)
    Qwen3ForCausalLM     q/k RMSNorm per head, explicit `head_dim`

RoPE settings are read the transformers 4 way (`rope_theta` + `rope_scaling`) or the transformers 5 way
(`rope_parameters`). Loading is strict: a tensor the model lacks, a tensor missing from the files, an unknown
RoPE type, a binding sliding window, MoE layers, biases on o_proj or the MLP, a non-SiLU activation are each a
`CheckpointError` naming the tensor or the key, before any worker starts. The only tensors skipped are
non-parameters (`rotary_emb.inv_freq` buffers) and a stored `lm_head.weight` of a tied model that equals the
embedding. Weights load as fp32 masters whatever the dtype on disk (bf16, fp16, fp32).

`max_seq_len` is the run's (longest prompt + response), not `max_position_embeddings`: it sizes the RoPE
tables and the KV block table, and must not exceed what the checkpoint was trained for.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.engine.checkpoint import CheckpointError
from tidal.engine.model import ModelArgs, RopeScaling, param_specs

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}
CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
#: shard size of `save_hf` (the size `transformers` uses by default)
MAX_SHARD_BYTES = 5 * 1024 ** 3
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some exporters store; not parameters


@dataclass(frozen=True)
class HFModel:
    """A checkpoint directory's model: what Tidal builds from it and what `save_hf` writes back."""

    path: str
    architecture: str
    args: ModelArgs
    dtype: str                       # on disk: float32 | bfloat16 | float16
    max_position_embeddings: int
    config: dict                     # config.json as read, written back (dtype updated) by save_hf

    @property
    def num_params(self) -> int:
        return self.args.num_params()


def _bad(field: str, value: object, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(field, value, problem, fix)


def _read_json(path: Path, field: str) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(field, str(path), "file not found",
                   "point model.path at a Hugging Face checkpoint directory (config.json + *.safetensors)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _bad(field, str(path), f"is not valid JSON ({err})", "restore the file from the checkpoint") from None
    if not isinstance(doc, dict):
        raise _bad(field, str(path), "is not a JSON object", "restore the file from the checkpoint")
    return doc


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from transformers 5's `rope_parameters` or transformers 4's keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:   # per-layer-type form: one type only here
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(cfg.get("rope_scaling") or {})
    theta = (params if isinstance(params, dict) else cfg).get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not (isinstance(theta, (int, float)) and math.isfinite(theta) and theta > 0):
        raise _bad(f"{where}: rope_theta", theta, "must be a finite number > 0", "fix config.json")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise _bad(f"{where}: rope type", kind, "is not supported (Tidal implements default, linear, llama3)",
                   "use a checkpoint with one of those RoPE types")
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor"}
    extra = sorted(set(scaling) - known)
    if extra:
        raise _bad(f"{where}: rope settings", extra, f"are not understood for rope type {kind!r}",
                   "use a checkpoint without them")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise _bad(f"{where}: partial_rotary_factor", scaling["partial_rotary_factor"], "is not supported",
                   "use a checkpoint with full rotary embeddings")
    if kind == "default":
        return float(theta), RopeScaling()
    fields = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                       "original_max_position_embeddings") if k in scaling}
    return float(theta), RopeScaling(rope_type=kind, **fields)


def _int(cfg: dict, key: str, where: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _bad(f"{where}: {key}", v, "must be a positive integer", "fix config.json")
    return v


def read_hf_config(path: str | Path, max_seq_len: int) -> HFModel:
    """The checkpoint's architecture as `ModelArgs` (with the run's `max_seq_len`); CheckpointError if Tidal
    cannot reproduce it exactly."""
    root = Path(path)
    if not root.is_dir():
        raise _bad("model.path", str(path), "is not a directory",
                   "point model.path at a Hugging Face checkpoint directory (config.json + *.safetensors); the "
                   "main job's is made by ./scripts/main (tidal warm-start experiments/warmstart_addition.yaml "
                   "--out runs/warmstart/addition)")
    cfg = _read_json(root / CONFIG_FILE, "model.path")
    where = str(root / CONFIG_FILE)
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if arch not in SUPPORTED:
        raise _bad(f"{where}: architectures", archs, "is not a supported family",
                   f"use one of {', '.join(SUPPORTED)} (dense decoders)")
    for moe_key in ("num_experts", "num_local_experts", "moe_intermediate_size"):
        if cfg.get(moe_key):
            raise _bad(f"{where}: {moe_key}", cfg[moe_key], "MoE layers are not supported", "use a dense model")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _bad(f"{where}: hidden_act", cfg["hidden_act"], "is not supported (SwiGLU with SiLU only)",
                   "use a checkpoint with hidden_act silu")
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM") and cfg.get("attention_bias"):
        raise _bad(f"{where}: attention_bias", True, "biases on q/k/v/o projections are not supported for "
                   f"{arch}", "use a checkpoint without attention_bias")
    if cfg.get("mlp_bias"):
        raise _bad(f"{where}: mlp_bias", True, "MLP biases are not supported", "use a checkpoint without them")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _bad(f"{where}: layer_types", sorted(set(layer_types)), "only full attention is supported",
                   "use a checkpoint whose layers all use full attention")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", arch == "MistralForCausalLM") and window is not None
    if uses_window and window is not None and window < max_seq_len:
        raise _bad(f"{where}: sliding_window", window, f"would bind within the run's {max_seq_len} tokens "
                   "(sliding-window attention is not implemented)",
                   f"keep prompts + responses within {window} tokens, or use a full-attention checkpoint")
    theta, scaling = _rope(cfg, where)
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    head_dim = cfg.get("head_dim") or hidden // heads
    max_pos = _int(cfg, "max_position_embeddings", where, 2048)
    if max_seq_len > max_pos:
        raise _bad("model.max_seq_len", max_seq_len, f"exceeds the checkpoint's max_position_embeddings={max_pos}",
                   f"keep data.max_prompt_length + the response length within {max_pos}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise _bad(f"{where}: rms_norm_eps", eps, "must be a finite number > 0", "fix config.json")
    args = ModelArgs(vocab_size=_int(cfg, "vocab_size", where), hidden_size=hidden,
                     num_layers=_int(cfg, "num_hidden_layers", where), num_heads=heads,
                     num_kv_heads=_int(cfg, "num_key_value_heads", where, heads),
                     intermediate_size=_int(cfg, "intermediate_size", where), max_seq_len=max_seq_len,
                     rope_theta=theta, norm_eps=float(eps), tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     head_dim=int(head_dim), qkv_bias=arch == "Qwen2ForCausalLM",
                     qk_norm=arch == "Qwen3ForCausalLM", rope_scaling=scaling)
    if heads % args.num_kv_heads or head_dim % 2:
        raise _bad(f"{where}: num_key_value_heads", args.num_kv_heads,
                   f"must divide num_attention_heads={heads} with an even head_dim ({head_dim})", "fix config.json")
    dtype = cfg.get("dtype", cfg.get("torch_dtype", "float32")) or "float32"
    if dtype not in _DTYPES:
        raise _bad(f"{where}: torch_dtype", dtype, "is not a supported dtype", "use float32, bfloat16 or float16")
    return HFModel(str(root), arch, args, dtype, max_pos, cfg)


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's, else `model.safetensors`, else every *.safetensors."""
    root = Path(path)
    if (root / INDEX_FILE).is_file():
        index = _read_json(root / INDEX_FILE, "model.path")
        wmap = index.get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise _bad("model.path", str(root / INDEX_FILE), "has no weight_map", "restore the index file")
        names = sorted(set(wmap.values()))
        for n in names:   # the index names files inside the checkpoint, never paths out of it
            if Path(n).name != n:
                raise _bad("model.path", n, f"{INDEX_FILE} names a file outside the checkpoint directory",
                           "restore the index file")
        files = [root / n for n in names]
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in root.glob("*.bin"))
        hint = (f"found {bins[:3]}: convert them to safetensors (transformers: model.save_pretrained(dir))"
                if bins else "save the model with save_pretrained (safetensors)")
        raise _bad("model.path", str(root), "has no *.safetensors weights", hint)
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise _bad("model.path", missing[0], "is listed in the index but missing", "restore the checkpoint's files")
    return files


@dataclass(frozen=True)
class WeightInventory:
    """What a checkpoint's files hold, read from the safetensors headers only (no tensor data)."""

    files: tuple[Path, ...]
    location: dict[str, tuple[Path, str]]   # parameter name (as `param_specs`) -> (file, key in it)
    tied_head: tuple[Path, str] | None      # a stored lm_head.weight of a tied model (must equal the embedding)
    dtypes: dict[str, int]                  # dtype on disk -> tensors
    nbytes: int                             # bytes of the weight files


_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def weight_inventory(model: HFModel) -> WeightInventory:
    """Every parameter of `model.args` exactly once with its shape, nothing left over (CheckpointError naming
    the tensor otherwise); reads headers only."""

    specs = {s.name: s for s in param_specs(model.args)}
    location: dict[str, tuple[Path, str]] = {}
    tied_head, nbytes = None, 0
    dtypes: dict[str, int] = {}
    files = weight_files(model.path)
    for f in files:
        nbytes += f.stat().st_size
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping: keys() but no __iter__
                name = key[len("model."):] if key.startswith("model.") else key
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and model.args.tie_embeddings:
                    tied_head = (f, key)
                    continue
                spec = specs.get(name)
                if spec is None:
                    raise _bad("model.path", key, f"tensor in {f.name} is not a parameter of this "
                               f"{model.architecture} (Tidal cannot use it, so the model would differ)",
                               "use a checkpoint of a supported family without extra modules")
                if name in location:
                    raise _bad("model.path", key, f"is stored twice (again in {f.name})", "restore the checkpoint")
                sl = st.get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != spec.shape:
                    raise _bad("model.path", key, f"has shape {shape}, config.json implies {spec.shape}",
                               "use the config.json saved with these weights")
                dt = _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype())
                dtypes[dt] = dtypes.get(dt, 0) + 1
                location[name] = (f, key)
    missing = [n for n in specs if n not in location]
    if missing:
        what = "bias" if missing[0].endswith(".bias") else "tensor"
        raise _bad("model.path", "model." + missing[0], f"{what} missing from the checkpoint "
                   f"({len(missing)} missing in all); {model.architecture} needs it",
                   "use a complete checkpoint (every shard of the index present)")
    odd = sorted(set(dtypes) - set(_DTYPES))
    if odd:
        raise _bad("model.path", odd, "tensors of an unsupported dtype", "use float32, bfloat16 or float16 weights")
    return WeightInventory(tuple(files), location, tied_head, dtypes, nbytes)


def load_hf_weights(model: HFModel) -> dict[str, torch.Tensor]:
    """Global fp32 weights named as `param_specs(model.args)` (checked by `weight_inventory` first)."""

    inv = weight_inventory(model)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (f, key) in inv.location.items():
        by_file.setdefault(f, []).append((name, key))
    out: dict[str, torch.Tensor] = {}
    for f, entries in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for name, key in entries:
                out[name] = st.get_tensor(key).to(torch.float32)
    if inv.tied_head is not None:
        f, key = inv.tied_head
        with safe_open(str(f), framework="pt") as st:
            head = st.get_tensor(key).to(torch.float32)
        if not torch.equal(head, out["embed_tokens.weight"]):
            raise _bad("model.path", "lm_head.weight", "differs from embed_tokens.weight while "
                       "tie_word_embeddings is true", "set tie_word_embeddings: false in config.json, or drop "
                       "the stored lm_head")
    return {s.name: out[s.name] for s in param_specs(model.args)}


@dataclass(frozen=True)
class HFWeights:
    """A checkpoint's weights by reference: each worker reads them from `model.path` itself (`load`), so the
    driver never holds the model and no copy of it crosses the object store (at 1.5B parameters that was 5.9 GB of
    fp32 spilled to disk before every worker read it back)."""

    model: HFModel

    def load(self) -> dict[str, torch.Tensor]:
        return load_hf_weights(self.model)


def hf_config_for(args: ModelArgs, architecture: str = "Qwen2ForCausalLM", *, bos_id: int | None = None,
                  eos_ids: tuple[int, ...] = (), pad_id: int | None = None) -> dict:
    """A config.json for weights Tidal made itself (the warm start), through transformers' config class."""
    from transformers import AutoConfig

    if architecture not in SUPPORTED:
        raise ValueError(f"unsupported architecture {architecture!r}")
    if args.qkv_bias != (architecture == "Qwen2ForCausalLM") or args.qk_norm != (architecture == "Qwen3ForCausalLM"):
        raise ValueError(f"{architecture} cannot express qkv_bias={args.qkv_bias}, qk_norm={args.qk_norm}")
    rs = args.rope_scaling
    rope = {"rope_type": rs.rope_type, "rope_theta": args.rope_theta}
    if rs.rope_type != "default":
        rope.update(factor=rs.factor, low_freq_factor=rs.low_freq_factor, high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings)
    kw = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
              num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
              intermediate_size=args.intermediate_size, max_position_embeddings=args.max_seq_len,
              rms_norm_eps=args.norm_eps, tie_word_embeddings=args.tie_embeddings, head_dim=args.head_dim,
              bos_token_id=bos_id, eos_token_id=list(eos_ids) if len(eos_ids) > 1 else (eos_ids or [None])[0],
              pad_token_id=pad_id, hidden_act="silu", rope_theta=args.rope_theta,
              rope_scaling=None if rs.rope_type == "default" else rope)
    cfg = AutoConfig.for_model(MODEL_TYPES[architecture], **kw)
    if hasattr(cfg, "rope_parameters"):   # transformers 5 keeps RoPE here
        cfg.rope_parameters = rope
    cfg.architectures = [architecture]
    return cfg.to_dict()


def _to_hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def save_hf(path: str | Path, weights: dict[str, torch.Tensor], model: HFModel, dtype: str | None = None,
            tokenizer=None, generation_config: dict | None = None) -> Path:
    """Write an HF checkpoint directory: config.json (the source's, dtype updated), safetensors (sharded past
    `MAX_SHARD_BYTES`, with an index), generation_config.json, the tokenizer's files (`tokenizer.save_pretrained`).
    Written into a temporary sibling and renamed, so a directory at `path` is complete or absent."""

    dtype = dtype or model.dtype
    torch_dtype = _DTYPES[dtype]
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names = [s.name for s in param_specs(model.args)]
    tensors = {_to_hf_name(n): weights[n].detach().to("cpu", torch_dtype).contiguous() for n in names}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    else:
        wmap = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            wmap.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": wmap}, indent=2))
    cfg = dict(model.config)
    cfg["architectures"] = [model.architecture]
    cfg["torch_dtype" if "torch_dtype" in cfg or "dtype" not in cfg else "dtype"] = dtype
    (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = generation_config
    if gen is None and (Path(model.path) / GENERATION_CONFIG).is_file():
        gen = _read_json(Path(model.path) / GENERATION_CONFIG, "model.path")
    if gen is not None:
        (tmp / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final
