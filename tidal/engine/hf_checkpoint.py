"""Hugging Face checkpoint directories in and out: `config.json` + `*.safetensors` <-> `ModelArgs` + fp32 weights.

    read_hf_config(dir, max_seq_len)  -> HFModel      architecture, ModelArgs, dtype on disk; strict
    weight_inventory(hf_model)        -> WeightInventory  every file's header against `param_specs`; no data read
    load_hf_weights(hf_model)         -> {name: fp32}  global tensors named as `param_specs`; strict, all finite
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
embedding. Weights load as fp32 masters whatever the dtype on disk (bf16, fp16, fp32); a NaN or inf in them is
an error naming the tensor and its file.

Nothing in the directory is trusted before it is checked, so a damaged or hostile checkpoint is one error naming
the file or the key (CLI exit 2), never a traceback, a hang or a silently different model:
- every file read (config.json, the index, the weights, generation_config.json, the tokenizer's files through
  `checkpoint_file`) is a regular file inside the directory once symlinks are resolved: no loop, no device such
  as /dev/zero, no target elsewhere (the blob store of a Hugging Face cache snapshot excepted); JSON files are read
  up to `MAX_JSON_BYTES`;
- each config.json field Tidal reads has its JSON type (an integer is not a string, a float or a bool) and a range
  (`INT_LIMITS`; at most `MAX_PARAMS` parameters in all);
- each weight file's header is read by `safetensors_header.read_header` (bounded; dtypes, shapes and offsets
  consistent, no truncation) and its tensors' names, shapes and dtypes match what config.json implies.

`max_seq_len` is the run's (longest prompt + response), not `max_position_embeddings`: it sizes the RoPE
tables and the KV block table, and must not exceed what the checkpoint was trained for.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tidal.core.errors import LayoutError
from tidal.engine.checkpoint import CheckpointError
from tidal.engine.model import ModelArgs, RopeScaling, param_specs
from tidal.engine.safetensors_header import read_header

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


# ---- the directory's files -------------------------------------------------------------------------------------

def _allowed_dirs(root: Path) -> tuple[Path, ...]:
    """Where the files of checkpoint directory `root` may live, symlinks resolved: `root` itself, and for a snapshot
    of the Hugging Face hub cache (`models--org--name/snapshots/<revision>`, whose files link to `../../blobs/`)
    that repository's blob store."""
    real = Path(os.path.realpath(root))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real, real.parent.parent / "blobs"
    return (real,)


def checkpoint_file(root: Path, name: str) -> Path | None:
    """`root / name` when it exists and loading can read it; None when absent. CheckpointError naming the file
    when it exists but cannot be read as a file of the checkpoint: a symlink loop or a dangling symlink, something
    other than a regular file (a directory; a device such as /dev/zero, which reads forever; a FIFO, which blocks),
    or a file that resolves outside the directory (`_allowed_dirs`): a checkpoint is its directory, and one that
    reaches out of it reads whatever the link points at on the machine that loads it."""
    p = root / name
    if not os.path.lexists(p):
        return None
    fix = f"replace {name} with the regular file saved with the checkpoint (copy it into {root})"
    try:
        st = os.stat(p)
    except OSError as err:   # ELOOP, a dangling link, a permission error
        raise _bad("model.path", str(p), f"{name} cannot be opened ({err.strerror})", fix) from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise _bad("model.path", str(p), f"{name} is {kind}, not a regular file", fix)
    real = Path(os.path.realpath(p))
    if not any(real.is_relative_to(d) for d in _allowed_dirs(root)):
        raise _bad("model.path", str(p), f"{name} resolves to {real}, outside the checkpoint directory", fix)
    return p


#: largest JSON file of a checkpoint read (config.json, the index, generation_config.json): real ones are kilobytes
MAX_JSON_BYTES = 64 * 1024 ** 2


def read_checkpoint_json(root: Path, name: str) -> dict:
    """`root / name` as a JSON object, read only after `checkpoint_file` accepts it and only up to MAX_JSON_BYTES;
    CheckpointError naming the file otherwise (absent included)."""
    path = checkpoint_file(root, name)
    if path is None:
        raise _bad("model.path", str(root / name), "file not found",
                   "point model.path at a Hugging Face checkpoint directory (config.json + *.safetensors)")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise _bad("model.path", str(path), f"{name} is {path.stat().st_size:,} bytes, more than the "
                   f"{MAX_JSON_BYTES:,} a checkpoint's JSON file may have", "restore the file from the checkpoint")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise _bad("model.path", str(path), f"{name} is not valid JSON ({type(err).__name__}: {err})"[:300],
                   "restore the file from the checkpoint") from None
    if not isinstance(doc, dict):
        raise _bad("model.path", str(path), f"{name} is not a JSON object", "restore the file from the checkpoint")
    return doc


# ---- config.json -----------------------------------------------------------------------------------------------

#: largest value accepted for each integer field of config.json that Tidal reads. Every dense decoder published
#: lies far inside them; a damaged config.json must not size RoPE tables, parameter lists or tensors from a
#: number such as 2**40.
INT_LIMITS = {"vocab_size": 2 ** 24, "hidden_size": 2 ** 17, "intermediate_size": 2 ** 20,
              "num_hidden_layers": 2 ** 12, "num_attention_heads": 2 ** 12, "num_key_value_heads": 2 ** 12,
              "head_dim": 2 ** 12, "max_position_embeddings": 2 ** 31, "sliding_window": 2 ** 31,
              "original_max_position_embeddings": 2 ** 31}
#: largest model accepted, in parameters: a config.json describing more is damaged
MAX_PARAMS = 2 * 10 ** 12
_FIX_CONFIG = "fix config.json (restore the one saved with these weights)"


def _int(doc: dict, key: str, where: str, default: int | None = None, section: str = "") -> int:
    """An integer field in 1..INT_LIMITS[key] (a bool, a float or a string is refused: JSON says what it means).
    `section`: the object holding `key` within config.json (e.g. "rope_parameters."), for the error's field."""
    v = doc.get(key, default)
    hi = INT_LIMITS[key]
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
        raise _bad(f"{where}: {section}{key}", v, f"must be an integer from 1 to {hi:,}", _FIX_CONFIG)
    return v


def _number(doc: dict, key: str, where: str, default: float, section: str = "") -> float:
    """A finite number > 0 (an int or a float, not a bool; below 1e300, so no int overflows a float)."""
    v = doc.get(key, default)
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e300):
        raise _bad(f"{where}: {section}{key}", v, "must be a finite number > 0", _FIX_CONFIG)
    return float(v)


def _flag(doc: dict, key: str, where: str, default: bool) -> bool:
    """true / false; null or absent is `default`."""
    v = doc.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{where}: {key}", v, "must be true or false", _FIX_CONFIG)
    return v


def _rope_source(cfg: dict, where: str) -> tuple[dict, dict, str]:
    """(the dict holding rope_theta, the scaling settings, their key): transformers 5's `rope_parameters` (per
    layer type: its `full_attention` entry) or transformers 4's top-level `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:   # per-layer-type form: one type only here
        params = params["full_attention"]
    legacy = cfg.get("rope_scaling")
    for key, v in (("rope_parameters", params), ("rope_scaling", legacy)):
        if v is not None and not isinstance(v, dict):
            raise _bad(f"{where}: {key}", v, "must be a JSON object", _FIX_CONFIG)
    if params is not None:
        return {"rope_theta": cfg.get("rope_theta", 10000.0), **params}, dict(params), "rope_parameters"
    return cfg, dict(legacy or {}), "rope_scaling"


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling), every field checked for type and range."""
    theta_doc, scaling, key = _rope_source(cfg, where)
    section = f"{key}."
    theta = _number(theta_doc, "rope_theta", where, 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in ("default", "linear", "llama3"):
        raise _bad(f"{where}: rope type", kind, "is not supported (Tidal implements default, linear, llama3)",
                   "use a checkpoint with one of those RoPE types")
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor"}
    extra = sorted(set(scaling) - known)
    if extra:
        raise _bad(f"{where}: rope settings", extra, f"are not understood for rope type {kind!r}",
                   "use a checkpoint without them")
    if _number(scaling, "partial_rotary_factor", where, 1.0, section) != 1.0:
        raise _bad(f"{where}: {section}partial_rotary_factor", scaling["partial_rotary_factor"], "is not supported",
                   "use a checkpoint with full rotary embeddings")
    if kind == "default":
        return theta, RopeScaling()
    d = RopeScaling()   # the defaults of a key config.json leaves out
    try:
        return theta, RopeScaling(
            rope_type=kind, factor=_number(scaling, "factor", where, d.factor, section),
            low_freq_factor=_number(scaling, "low_freq_factor", where, d.low_freq_factor, section),
            high_freq_factor=_number(scaling, "high_freq_factor", where, d.high_freq_factor, section),
            original_max_position_embeddings=_int(scaling, "original_max_position_embeddings", where,
                                                  d.original_max_position_embeddings, section))
    except LayoutError as err:   # llama3's factor ordering: the same words, naming config.json
        raise _bad(f"{where}: {err.field}", err.value, err.problem, _FIX_CONFIG) from None


def _check_supported(cfg: dict, arch: str, where: str, max_seq_len: int) -> None:
    """The config.json features Tidal does not implement, each refused naming its key."""
    for moe_key in ("num_experts", "num_local_experts", "moe_intermediate_size"):
        if cfg.get(moe_key):
            raise _bad(f"{where}: {moe_key}", cfg[moe_key], "MoE layers are not supported", "use a dense model")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _bad(f"{where}: hidden_act", cfg["hidden_act"], "is not supported (SwiGLU with SiLU only)",
                   "use a checkpoint with hidden_act silu")
    biased = _flag(cfg, "attention_bias", where, False)
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM") and biased:
        raise _bad(f"{where}: attention_bias", True, "biases on q/k/v/o projections are not supported for "
                   f"{arch}", "use a checkpoint without attention_bias")
    if _flag(cfg, "mlp_bias", where, False):
        raise _bad(f"{where}: mlp_bias", True, "MLP biases are not supported", "use a checkpoint without them")
    layer_types = cfg.get("layer_types") or []
    if not (isinstance(layer_types, list) and all(isinstance(t, str) for t in layer_types)):
        raise _bad(f"{where}: layer_types", layer_types, "must be a list of strings (each layer's attention type)",
                   _FIX_CONFIG)
    if any(t != "full_attention" for t in layer_types):
        raise _bad(f"{where}: layer_types", sorted(set(layer_types)), "only full attention is supported",
                   "use a checkpoint whose layers all use full attention")
    window = None if cfg.get("sliding_window") is None else _int(cfg, "sliding_window", where)
    uses_window = _flag(cfg, "use_sliding_window", where, arch == "MistralForCausalLM") and window is not None
    if uses_window and window is not None and window < max_seq_len:
        raise _bad(f"{where}: sliding_window", window, f"would bind within the run's {max_seq_len} tokens "
                   "(sliding-window attention is not implemented)",
                   f"keep prompts + responses within {window} tokens, or use a full-attention checkpoint")


def _model_args(cfg: dict, arch: str, where: str, max_seq_len: int) -> ModelArgs:
    """The architecture's sizes, each an integer in its INT_LIMITS range, heads dividing evenly, the whole model
    under MAX_PARAMS parameters."""
    theta, scaling = _rope(cfg, where)
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    head_dim = hidden // heads if cfg.get("head_dim") is None else _int(cfg, "head_dim", where)
    eps = _number(cfg, "rms_norm_eps", where, 1e-6)
    args = ModelArgs(vocab_size=_int(cfg, "vocab_size", where), hidden_size=hidden,
                     num_layers=_int(cfg, "num_hidden_layers", where), num_heads=heads,
                     num_kv_heads=_int(cfg, "num_key_value_heads", where, heads),
                     intermediate_size=_int(cfg, "intermediate_size", where), max_seq_len=max_seq_len,
                     rope_theta=theta, norm_eps=eps, tie_embeddings=_flag(cfg, "tie_word_embeddings", where, False),
                     head_dim=head_dim, qkv_bias=arch == "Qwen2ForCausalLM",
                     qk_norm=arch == "Qwen3ForCausalLM", rope_scaling=scaling)
    if heads % args.num_kv_heads or head_dim % 2 or head_dim < 2:
        raise _bad(f"{where}: num_key_value_heads", args.num_kv_heads,
                   f"must divide num_attention_heads={heads} with an even head_dim ({head_dim})", _FIX_CONFIG)
    n = args.num_params()
    if n > MAX_PARAMS:
        raise _bad(f"{where}: hidden_size", hidden, f"with vocab_size={args.vocab_size}, num_hidden_layers="
                   f"{args.num_layers}, intermediate_size={args.intermediate_size} describes {n:,} parameters, "
                   f"more than the {MAX_PARAMS:,} of any model Tidal loads", _FIX_CONFIG)
    return args


def read_hf_config(path: str | Path, max_seq_len: int) -> HFModel:
    """The checkpoint's architecture as `ModelArgs` (with the run's `max_seq_len`); CheckpointError if Tidal
    cannot reproduce it exactly, or if a field Tidal reads has the wrong type or an impossible size."""
    root = Path(path)
    if not root.is_dir():
        raise _bad("model.path", str(path), "is not a directory",
                   "point model.path at a Hugging Face checkpoint directory (config.json + *.safetensors); the "
                   "main job's is made by ./scripts/main (tidal warm-start experiments/warmstart_addition.yaml "
                   "--out runs/warmstart/addition)")
    cfg = read_checkpoint_json(root, CONFIG_FILE)
    where = str(root / CONFIG_FILE)
    archs = cfg.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if not isinstance(arch, str) or arch not in SUPPORTED:
        raise _bad(f"{where}: architectures", archs, "is not a supported family",
                   f"use one of {', '.join(SUPPORTED)} (dense decoders)")
    _check_supported(cfg, arch, where, max_seq_len)
    args = _model_args(cfg, arch, where, max_seq_len)
    max_pos = _int(cfg, "max_position_embeddings", where, 2048)
    if max_seq_len > max_pos:
        raise _bad("model.max_seq_len", max_seq_len, f"exceeds the checkpoint's max_position_embeddings={max_pos}",
                   f"keep data.max_prompt_length + the response length within {max_pos}")
    dtype_key = "dtype" if "dtype" in cfg else "torch_dtype"   # transformers 5 writes `dtype`, 4 `torch_dtype`
    dtype = cfg.get(dtype_key) or "float32"
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _bad(f"{where}: {dtype_key}", dtype, "is not a supported dtype", "use float32, bfloat16 or float16")
    return HFModel(str(root), arch, args, dtype, max_pos, cfg)


# ---- the weights -----------------------------------------------------------------------------------------------

def _listed_file(root: Path, name: object) -> Path:
    """A file the index names: a plain name (no path out of the directory) that `checkpoint_file` accepts."""
    if not isinstance(name, str) or Path(name).name != name:
        raise _bad("model.path", name, f"{INDEX_FILE} names it as a weight file: not a file name inside the "
                   "checkpoint directory", "restore the index file")
    path = checkpoint_file(root, name)
    if path is None:
        raise _bad("model.path", str(root / name), "is listed in the index but missing",
                   "restore the checkpoint's files")
    return path


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's, else `model.safetensors`, else every *.safetensors;
    each accepted by `checkpoint_file`."""
    root = Path(path)
    if checkpoint_file(root, INDEX_FILE) is not None:
        wmap = read_checkpoint_json(root, INDEX_FILE).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise _bad("model.path", str(root / INDEX_FILE), "has no weight_map", "restore the index file")
        files = sorted({_listed_file(root, n) for n in wmap.values()})
    elif (single := checkpoint_file(root, SINGLE_FILE)) is not None:
        files = [single]
    else:
        # glob lists names that exist, so checkpoint_file returns each path or raises
        files = [cast(Path, checkpoint_file(root, p.name)) for p in sorted(root.glob("*.safetensors"))]
    if not files:
        bins = sorted(p.name for p in root.glob("*.bin"))
        hint = (f"found {bins[:3]}: convert them to safetensors (transformers: model.save_pretrained(dir))"
                if bins else "save the model with save_pretrained (safetensors)")
        raise _bad("model.path", str(root), "has no *.safetensors weights", hint)
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
    """Every parameter of `model.args` exactly once with its shape, nothing left over, every file's header intact
    (`safetensors_header.read_header`: a truncated or damaged file is refused); CheckpointError naming the tensor
    or the file otherwise. Reads headers only."""

    specs = {s.name: s for s in param_specs(model.args)}
    location: dict[str, tuple[Path, str]] = {}
    tied_head, nbytes = None, 0
    dtypes: dict[str, int] = {}
    files = weight_files(model.path)
    for f in files:
        nbytes += f.stat().st_size
        for key, entry in read_header(f).tensors.items():
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
            if entry.shape != spec.shape:
                raise _bad("model.path", key, f"tensor in {f.name} has shape {entry.shape}, config.json implies "
                           f"{spec.shape}", "use the config.json saved with these weights")
            dt = _ST_DTYPES.get(entry.dtype, entry.dtype)
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


def _finite(t: torch.Tensor, f: Path, key: str) -> torch.Tensor:
    """`t` when every value is finite; a NaN or inf in a checkpoint would surface only mid-run, as a diverged loss
    blamed on the learning rate, so it is refused here naming the tensor and its file."""
    if not bool(torch.isfinite(t).all()):
        bad = t.numel() - int(torch.isfinite(t).sum())
        raise _bad("model.path", str(f), f"{f.name}: tensor {key} holds {bad:,} non-finite values (NaN or inf) "
                   f"of {t.numel():,}", "use an intact checkpoint (re-download it, or export it again from a model "
                   "whose weights are finite)")
    return t


def load_hf_weights(model: HFModel) -> dict[str, torch.Tensor]:
    """Global fp32 weights named as `param_specs(model.args)` (checked by `weight_inventory` first), every value
    finite."""

    inv = weight_inventory(model)
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (f, key) in inv.location.items():
        by_file.setdefault(f, []).append((name, key))
    out: dict[str, torch.Tensor] = {}
    for f, entries in by_file.items():
        with safe_open(str(f), framework="pt") as st:
            for name, key in entries:
                out[name] = _finite(st.get_tensor(key).to(torch.float32), f, key)
    if inv.tied_head is not None:
        f, key = inv.tied_head
        with safe_open(str(f), framework="pt") as st:
            head = _finite(st.get_tensor(key).to(torch.float32), f, key)
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
    if gen is None and checkpoint_file(Path(model.path), GENERATION_CONFIG) is not None:
        gen = read_checkpoint_json(Path(model.path), GENERATION_CONFIG)
    if gen is not None:
        (tmp / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final
