"""The run configuration's constraints that span sections (`tidal.core.config.build_config` calls
`check_cross_fields` once every section validated on its own): each broken one a `ConfigError` naming the field
and the fix, the first in the order below reported.
"""

from __future__ import annotations

import importlib.util
import re
from typing import TYPE_CHECKING

from tidal.core.errors import ConfigError
from tidal.core.placement import COMPONENTS

if TYPE_CHECKING:
    from tidal.core.config import TidalConfig

#: a value that names a URL (`scheme:/...`, two letters or more: `C:/` is a Windows drive)
_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]+:/")
#: ModelConfig keys that config.json gives when model.path is set
ARCH_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "rope_theta", "norm_eps", "tie_embeddings")


def check_cross_fields(cfg: TidalConfig) -> None:
    """Constraints that span sections, checked in this order (the first broken one is reported). Raises
    ConfigError."""
    _check_parallel_sizes(cfg)
    _check_model_source(cfg)
    _check_lengths(cfg)
    _check_data_files(cfg)
    budget = cfg.actor.max_tokens_per_micro_batch
    if budget is not None and budget < cfg.max_seq_len:
        raise ConfigError("actor.max_tokens_per_micro_batch", budget,
                          f"cannot hold one sequence of model.max_seq_len={cfg.max_seq_len} tokens",
                          f"give at least {cfg.max_seq_len} (e.g. 8 x that for 8 sequences), or null")
    _check_actor_backend(cfg)
    _check_run_policies(cfg)
    _check_rollout_correction(cfg)
    _check_async(cfg)


def _check_parallel_sizes(cfg: TidalConfig) -> None:
    """Each component's TP size against its devices and the model's heads; the minibatch count against the step."""
    p = cfg.placement
    m = cfg.model
    for comp in COMPONENTS:
        tp = getattr(cfg, comp).tensor_parallel_size
        n = len(p.of(comp))
        if n % tp:
            raise ConfigError(f"{comp}.tensor_parallel_size", tp,
                              f"does not divide the {n} devices placed for {comp}",
                              f"use a divisor of {n} or place a multiple of {tp} devices")
        if m.num_kv_heads % tp or m.num_heads % tp:
            raise ConfigError(f"{comp}.tensor_parallel_size", tp,
                              f"does not divide num_heads={m.num_heads} and num_kv_heads={m.num_kv_heads}",
                              "use a TP size that divides both")
    total = cfg.data.rollout_batch_size * cfg.algorithm.group_size
    if total % cfg.algorithm.n_minibatches:
        raise ConfigError("algorithm.n_minibatches", cfg.algorithm.n_minibatches,
                          f"does not divide the step's {total} sequences (rollout_batch_size x group_size)",
                          "use a divisor so every iter has the same global batch")


def _check_model_source(cfg: TidalConfig) -> None:
    """A checkpoint directory gives the architecture: exports need one, and the config may not restate it."""
    m = cfg.model
    if cfg.run.save_hf and m.path is None:
        raise ConfigError("run.save_hf", True, "exports need model.path: its config.json names the architecture "
                          "and its tokenizer travels with the model", "set model.path, or drop run.save_hf")
    if m.path is not None:
        clash = [k for k in ARCH_KEYS if k in m.model_fields_set]
        if clash:
            raise ConfigError(f"model.{clash[0]}", getattr(m, clash[0]),
                              f"contradicts model.path={m.path!r}, whose config.json gives the architecture",
                              f"drop model.{', model.'.join(clash)} (or model.path to build Tidal's own model)")


def _check_lengths(cfg: TidalConfig) -> None:
    """One response cap, and room for a prompt next to it within model.max_seq_len."""
    d = cfg.data
    if d.max_response_length is not None and "max_new_tokens" in cfg.rollout.model_fields_set \
            and cfg.rollout.max_new_tokens != d.max_response_length:
        raise ConfigError("data.max_response_length", d.max_response_length,
                          f"contradicts rollout.max_new_tokens={cfg.rollout.max_new_tokens} (the same cap)",
                          "set only one of them")
    if cfg.response_length >= cfg.max_seq_len:
        raise ConfigError("rollout.max_new_tokens", cfg.response_length,
                          f"leaves no room for the prompt within model.max_seq_len={cfg.max_seq_len}",
                          "lower max_new_tokens or raise model.max_seq_len")


def _check_data_files(cfg: TidalConfig) -> None:
    """Local paths only; text data comes as a train and a held-out split, with a real tokenizer and room for a
    response."""
    d = cfg.data
    for name, paths in (("model.path", [cfg.model.path] if cfg.model.path else []),
                        ("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        url = next((p for p in paths if _URL.match(p)), None)
        if url is not None:
            raise ConfigError(name, url, "is a URL: Tidal reads local files and directories, it fetches nothing",
                              "download it first (e.g. `huggingface-cli download`, `curl -o`) and give the local path")
    if d.train_files and "task" in d.model_fields_set:
        raise ConfigError("data.task", d.task, "is the built-in task, but data.train_files gives the prompts",
                          "drop data.task, or data.train_files to train on the built-in task")
    if d.train_files and not d.val_files:
        raise ConfigError("data.val_files", [], "is empty: held-out accuracy needs its own prompts",
                          "add the held-out split, e.g. data.val_files: [gsm8k/test.parquet]")
    if d.val_files and not d.train_files:
        raise ConfigError("data.val_files", d.val_files, "needs data.train_files (the built-in task holds its "
                          "own held-out split)", "add data.train_files or drop data.val_files")
    if d.train_files and not cfg.model.path:
        raise ConfigError("data.train_files", d.train_files, "needs model.path: text data needs a real tokenizer",
                          "set model.path to a Hugging Face checkpoint directory (with its tokenizer)")
    if d.train_files and d.max_prompt_length >= cfg.max_seq_len:
        raise ConfigError("data.max_prompt_length", d.max_prompt_length,
                          f"leaves no room for a response within model.max_seq_len={cfg.max_seq_len}",
                          "lower data.max_prompt_length or raise model.max_seq_len")


def _check_run_policies(cfg: TidalConfig) -> None:
    """Flags read only by a restarting run or by dynamic scheduling, refused where nothing would read them."""
    if cfg.actor.redundancy != "none" and cfg.run.max_restarts < 1:
        raise ConfigError("actor.redundancy", cfg.actor.redundancy, "is read only by a run that restarts itself, and "
                          "run.max_restarts is 0", "set run.max_restarts >= 1, or actor.redundancy: none")
    if cfg.cluster.use_pre_process_policy and not cfg.cluster.auto_scheduler:
        raise ConfigError("cluster.use_pre_process_policy", True, "needs dynamic scheduling",
                          "set cluster.auto_scheduler: true or drop the flag")
    if cfg.cluster.use_wait_before_last_iter_policy and not cfg.cluster.auto_scheduler:
        raise ConfigError("cluster.use_wait_before_last_iter_policy", True, "needs dynamic scheduling",
                          "set cluster.auto_scheduler: true or drop the flag")


def _check_actor_backend(cfg: TidalConfig) -> None:
    """What the megatron actor backend cannot do yet, refused before anything starts (docs/megatron.md)."""
    a = cfg.actor
    if a.backend != "megatron":
        return
    if a.activation_checkpointing:
        raise ConfigError("actor.activation_checkpointing", True, "with actor.backend: megatron: recompute is not "
                          "wired to megatron-core's", "set it false, or actor.backend: native")
    if a.on_nonfinite == "skip":
        raise ConfigError("actor.on_nonfinite", "skip", "with actor.backend: megatron: megatron-core's optimizer "
                          "applies a non-finite update without a loss scaler, so it cannot be dropped",
                          "use actor.on_nonfinite: stop, or actor.backend: native")
    if a.megatron_transformer_engine is True and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("actor.megatron_transformer_engine", True, "needs Transformer Engine, but "
                          "`transformer_engine` is not installed here",
                          "install it (pip install 'transformer_engine[pytorch]', CUDA only), or set "
                          "actor.megatron_transformer_engine: auto (TE where it imports) or false")


def _check_rollout_correction(cfg: TidalConfig) -> None:
    """One off-policy correction at a time, its cap only with it, and a sampler whose log-probs are the policy's
    (the actor's log-probs carry no temperature; tidal/engine/rollout_correction.py)."""
    a = cfg.algorithm
    if a.rollout_is is not None and a.use_decoupled_loss:
        raise ConfigError("algorithm.use_decoupled_loss", True, f"and algorithm.rollout_is={a.rollout_is} are two "
                          "corrections of the same ratio",
                          "choose one: drop use_decoupled_loss or set rollout_is: null")
    if a.behav_imp_weight_cap is not None and not a.use_decoupled_loss:
        raise ConfigError("algorithm.behav_imp_weight_cap", a.behav_imp_weight_cap,
                          "is read only by the decoupled loss", "set algorithm.use_decoupled_loss: true or drop it")
    if (a.rollout_is is not None or a.use_decoupled_loss) and cfg.rollout.temperature != 1.0:
        key = "algorithm.rollout_is" if a.rollout_is is not None else "algorithm.use_decoupled_loss"
        raise ConfigError(key, a.rollout_is or True, f"weighs the sampler's log-probs against the actor's, and "
                          f"rollout.temperature={cfg.rollout.temperature:g} makes them two different policies "
                          "(the actor's carry no temperature)", "sample at rollout.temperature: 1, or drop the "
                          "correction")


def _check_async(cfg: TidalConfig) -> None:
    """What asynchronous steps (`algorithm.max_staleness` >= 1) run on: rollout instances on devices of their own,
    on a placement the scheduler does not move (tidal/pipeline/ahead.py)."""
    k = cfg.algorithm.max_staleness
    if not k:
        return
    if cfg.cluster.auto_scheduler:
        raise ConfigError("algorithm.max_staleness", k, "asynchronous steps run on static placements: dynamic "
                          "scheduling does not move instances holding later steps' groups",
                          "set cluster.auto_scheduler: false, or algorithm.max_staleness: 0")
    p = cfg.placement
    shared = sorted(set(p.rollout) & (set(p.actor) | set(p.inference)))
    if shared:
        raise ConfigError("algorithm.max_staleness", k, f"needs rollout on devices of its own, and devices {shared} "
                          "also hold the actor or inference (rollout there waits for them each step)",
                          "place rollout on devices no other component uses, or set algorithm.max_staleness: 0")
    if cfg.rollout.backend != "native":
        raise ConfigError("algorithm.max_staleness", k, f"updates weights with requests in flight, which the "
                          f"{cfg.rollout.backend} backend does not", "use rollout.backend: native")
