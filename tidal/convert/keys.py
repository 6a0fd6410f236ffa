"""RLinf keys that Tidal knows but does not carry, each with the reason `tidal convert rlinf` reports.

`reason(key, value)` is the reason for an uncarried leaf: keys whose verdict depends on the value (`_BY_VALUE`:
"matches Tidal's behaviour" or "value not supported") first, then the first glob of `_REASONS` matching the dotted
key, else "no Tidal equivalent". The mapping (`mapping`) gives its own reasons for keys it looks at.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_MEGATRON = ("Megatron-LM setting; Tidal configures megatron-core itself from model.path and actor.* "
             "(actor.backend: megatron)")
_FSDP = "FSDP setting; Tidal's actor is its own engine"
_ENGINE = "SGLang/vLLM engine setting; no Tidal equivalent"
_HYDRA = "Hydra runtime setting; Tidal configs are plain YAML, not launched through Hydra"
_LOGGER = "RLinf logger setting; Tidal tracks runs in MLflow (tracking.*)"
_GROUP = "Ray worker-group name; Tidal names its workers itself"
_TOKENIZER = "tokenizer option; Tidal loads the tokenizer from model.path"
_ARCH = "architecture tag; Tidal reads the architecture from model.path's config.json"
_DYN = "RLinf dynamic-scheduler knob; Tidal's scheduler (scheduler.*) has no equivalent"
NODE_GROUPS = ("heterogeneous node groups are not supported: Tidal's devices are cluster.num_nodes x "
               "cluster.num_devices_per_node")
NULL = "null (not set): Tidal's default applies"
NO_EQUIV = "no Tidal equivalent"

#: (glob over the dotted key, reason), first match wins; keys whose reason depends on the value are in `_BY_VALUE`.
_REASONS: tuple[tuple[str, str], ...] = (
    ("hydra.*", _HYDRA),
    ("*.group_name", _GROUP),
    ("runner.logger.*", _LOGGER),
    ("runner.enable_dynamic_batch_size", "dynamic batching by token budget; Tidal batches by sequences "
                                         "(actor.micro_batch_size)"),
    ("runner.max_tokens_per_mbs", "dynamic batching by token budget; Tidal batches by sequences "
                                  "(actor.micro_batch_size)"),
    ("runner.resume_dir", "resume from Tidal's own checkpoints (run.output_dir)"),
    ("actor.megatron.*", _MEGATRON),
    ("actor.fsdp_config.*", _FSDP),
    ("inference.fsdp_config.*", _FSDP),
    ("actor.mcore_gpt", _MEGATRON), ("actor.spec_name", _MEGATRON),
    ("actor.checkpoint_load_path", "Megatron checkpoint; Tidal starts from the Hugging Face checkpoint in model.path"),
    ("actor.enable_offload", "FSDP's offload switch; Tidal offloads with actor.offload_optimizer / _grad / _weight"),
    ("actor.enable_dp_load_balance", NO_EQUIV), ("actor.calculate_flops", NO_EQUIV),
    ("actor.global_batch_size", "Tidal's global batch per iter is rollout_batch_size x group_size / n_minibatches"),
    ("actor.model.model_type", _ARCH),
    ("actor.model.*", "Megatron model/kernel setting; Tidal's actor is its own engine (architecture from "
                      "model.path)"),
    ("actor.optim.bf16", "mixed-precision flag; Tidal's precision is actor.dtype (from actor.model.precision)"),
    ("actor.optim.fp16", "mixed-precision flag; Tidal's precision is actor.dtype (from actor.model.precision)"),
    ("actor.optim.min_lr", "Megatron optimizer floor; Tidal's LR floor is actor.min_lr_ratio (from actor.lr_sched)"),
    ("actor.optim.*", _MEGATRON),
    ("actor.lr_sched.lr_warmup_init", "Tidal's warmup rises linearly to actor.lr (no start value)"),
    ("actor.lr_sched.lr_decay_iters", "Tidal decays over the run's optimizer steps (run.num_steps x "
                                      "algorithm.n_minibatches)"),
    ("actor.tokenizer.*", _TOKENIZER),
    ("reward.tokenizer.*", _TOKENIZER),
    ("rollout.model_arch", _ARCH), ("rollout.model.model_type", _ARCH), ("inference.model_arch", _ARCH),
    ("rollout.sglang.*", _ENGINE), ("rollout.vllm.*", _ENGINE),
    ("rollout.return_logprobs", "Tidal recomputes old log-probs on the inference component"),
    ("rollout.precision", "Tidal's rollout runs in the actor's dtype"),
    ("rollout.model.precision", "Tidal's rollout runs in the actor's dtype"),
    ("rollout.*", _ENGINE),
    ("inference.model.sequence_parallel", _MEGATRON),
    ("inference.load_from_actor", NO_EQUIV),
    ("inference.model.*", _MEGATRON),
    ("algorithm.sampling_params.min_new_tokens", NO_EQUIV),
    ("algorithm.rollout_batch_size_per_gpu", "Tidal spreads a step's prompts over the rollout instances itself"),
    ("algorithm.val_rollout_batch_size_per_gpu", NO_EQUIV),
    ("data.val_rollout_batch_size", NO_EQUIV),
    ("data.type", "RLinf dataset class; Tidal reads data.train_files (.jsonl/.parquet) directly"),
    ("data.dataset_name", "RLinf dataset name; Tidal reads data.train_files directly"),
    ("data.num_workers", NO_EQUIV), ("data.validation_shuffle", NO_EQUIV),
    ("reward.reward_scale", "Tidal's rewards are the reward function's values, unscaled"),
    ("cluster.node_groups*", NODE_GROUPS),
    ("cluster.nsight*", "Nsight profiling wrapper; no Tidal equivalent"),
    ("cluster.assign_policy", _DYN), ("cluster.migrate_out_max_bs", _DYN), ("cluster.monitor_interval", _DYN),
    ("cluster.rollout_use_all_gpus", _DYN), ("cluster.recreate_nccl_groups", _DYN),
    ("cluster.fuse_rollout_inference_only", _DYN),
)


def exactly(value: Any, *options: Any) -> bool:
    """`value` equals one of `options` with the same type (1 is not True, 0 is not 0.0 here)."""
    return any(value == o and type(value) is type(o) for o in options)


def _matches(desc: str) -> Callable[[Any], str]:
    return lambda v: f"matches Tidal's behaviour: {desc}"


def _by_value(ok: Callable[[Any], bool], desc: str, bad: str) -> Callable[[Any], str]:
    return lambda v: f"matches Tidal's behaviour: {desc}" if ok(v) else f"value not supported: {bad}"


def _ONE(v: Any) -> bool:
    return exactly(v, 1)


_PP = _by_value(_ONE, "no pipeline parallelism", "Tidal has no pipeline parallelism")
_BY_VALUE: dict[str, Callable[[Any], str]] = {
    "algorithm.recompute_logprobs": _by_value(lambda v: v is True, "old log-probs are always recomputed (inference)",
                                              "Tidal always recomputes old log-probs; rollout log-probs are unused"),
    "actor.model.pipeline_model_parallel_size": _PP, "rollout.pipeline_parallel_size": _PP,
    "inference.model.pipeline_model_parallel_size": _PP,
    "algorithm.sampling_params.repetition_penalty": _by_value(lambda v: v in (1, 1.0) and v is not True,
                                                             "no repetition penalty",
                                                             "Tidal samples without a repetition penalty"),
    "reward.use_reward_model": _by_value(lambda v: v is False, "rule-based reward (reward.function)",
                                         "Tidal has no reward model; rewards come from reward.function"),
    "critic.use_critic_model": _by_value(lambda v: v is False, "GRPO needs no critic", "Tidal has no critic"),
    "actor.model.is_lora": _by_value(lambda v: v is False, "full-parameter training",
                                     "Tidal trains all parameters (no LoRA)"),
    "algorithm.clip_ratio_low": _by_value(lambda v: v is None, "null means ratio_clip_eps on both sides",
                                          "asymmetric clipping; algorithm.clip_eps is taken from ratio_clip_eps"),
    "algorithm.clip_ratio_high": _by_value(lambda v: v is None, "null means ratio_clip_eps on both sides",
                                           "asymmetric clipping; algorithm.clip_eps is taken from ratio_clip_eps"),
    "algorithm.clip_ratio_c": _by_value(lambda v: v is None, "no dual clip", "Tidal has no dual-clip PPO"),
    "algorithm.entropy_bonus": _by_value(lambda v: v in (0, 0.0) and v is not False, "no entropy bonus",
                                         "Tidal's loss has no entropy term"),
    "runner.task_type": _by_value(lambda v: v in ("math", "reasoning"), "reasoning RL",
                                  "Tidal runs reasoning (math) RL only"),
    "actor.optim.optimizer": _by_value(lambda v: v in ("adam", "adamw"), "the optimizer is AdamW",
                                       "Tidal's optimizer is AdamW"),
    "actor.lr_sched.lr_warmup_fraction": _by_value(lambda v: v in (None, 0, 0.0) and v is not False,
                                                   "no fractional warmup",
                                                   "Tidal's warmup is counted in iters (actor.warmup_iters, from "
                                                   "lr_sched.lr_warmup_iters)"),
    "algorithm.sampling_params.use_greedy": _matches("sampling; greedy would be rollout.temperature: 0"),
    "algorithm.sampling_params.do_sample": _matches("sampling; greedy would be rollout.temperature: 0"),
}


def reason(key: str, value: Any) -> str:
    """Why the RLinf leaf `key` (with its resolved `value`) is not carried: by value, else by key pattern."""
    if key in _BY_VALUE:
        return _BY_VALUE[key](value)
    return pattern_reason(key)


def pattern_reason(key: str) -> str:
    """Why `key` is not carried, from the key alone (first matching pattern; no Tidal equivalent otherwise)."""
    for pattern, why in _REASONS:
        if _glob(pattern, key):
            return why
    return NO_EQUIV


def _glob(pattern: str, key: str) -> bool:
    rx = "".join(".*" if c == "*" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, key) is not None

