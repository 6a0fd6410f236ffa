"""`tidal convert rlinf FILE`: turn an RLinf experiment YAML into a Tidal config, saying what was not carried.

RLinf (github.com/RLinf/RLinf) configs are Hydra/OmegaConf files: a `defaults:` list, `${a.b}` references,
resolvers such as `${oc.env:VAR,default}` and RLinf's own `${subtract:x,y}`. The file is read with
`yaml.safe_load` (no Hydra, no OmegaConf YAML loader), its interpolations are resolved by OmegaConf with RLinf's
resolvers registered (`interpolation`), every key that has a Tidal equivalent is mapped
(`mapping`) and every other leaf key is listed in `Conversion.dropped` with the reason
(`keys` for the keys known not to carry).

Interpolations (`resolve_interpolations`): OmegaConf's grammar and its `oc.env`, `oc.select`, `oc.decode`, plus
RLinf's `${subtract:x,y}`, `${multiply:x,y}`, `${int_div:x,y}`, `${not:x}`. A missing key, a cycle, an unset
environment variable or any other resolver (`${eval:...}`, `${hydra:...}`) is a `ConfigError` naming the key that
holds it and the reference. `convert` resolves leniently: a leaf that cannot be resolved is only an error when
Tidal needs its value; otherwise it is listed as dropped with the cause.

Mapping (RLinf key -> Tidal key; values checked and converted, see `Conversion.carried` for the exact list):

    cluster.num_nodes / num_gpus_per_node / component_placement      cluster.num_nodes / num_devices_per_node /
    cluster.auto_scheduler, use_pre_process_policy,                  component_placement (normalised, below) and
      use_wait_before_last_iter_policy                               the three flags verbatim
    cluster.preprocess_threshold                                     scheduler.pre_process_threshold
    rollout.model.model_path | rollout.model_dir | actor.model.model_path | actor.tokenizer.tokenizer_model
                                                                     model.path (first one set; the others must agree)
    runner.seq_length                                                model.max_seq_len
    runner.max_steps (> 0), experiment_name, output_dir,             run.num_steps, name, output_dir,
      val_check_interval, save_interval; actor.seed                  eval_every, checkpoint_every; run.seed
    runner.logger.project_name                                       tracking.experiment
    actor.model.tensor_model_parallel_size, actor.model.precision    actor.tensor_parallel_size, actor.dtype
    actor.training_backend: megatron (fsdp: dropped, native trains)  actor.backend
    actor.optim.lr, adam_beta1/adam_beta2, adam_eps, weight_decay,   actor.lr, betas, eps, weight_decay, grad_clip
      clip_grad
    actor.lr_sched.lr_warmup_iters, lr_decay_style (+ min_lr)        actor.warmup_iters, min_lr_ratio
    algorithm.training_batch_size_per_gpu (or actor.micro_batch_size)    actor.micro_batch_size
    algorithm.sampling_params.temperature, top_p, top_k,             rollout.temperature, top_p, top_k,
      max_new_tokens, use_greedy / do_sample                         max_new_tokens (greedy -> temperature 0)
    rollout.tensor_parallel_size, max_running_requests, rollout_backend: vllm    rollout.*, rollout.backend
    inference.model.tensor_model_parallel_size                       inference.tensor_parallel_size
    algorithm.group_size, n_minibatches, ratio_clip_eps, kl_beta,    algorithm.group_size, n_minibatches, clip_eps,
      adv_type (grpo)                                                kl_coef, name
    data.train_data_paths, val_data_paths, prompt_key, answer_key,   data.train_files, val_files, prompt_key,
      max_prompt_length, rollout_batch_size, shuffle,                answer_key, max_prompt_length, ...
      apply_chat_template, apply_chat_template_kwargs, seed          ..., chat_template_kwargs, seed
    data.filter_prompt_by_length: true                               data.truncation: filter
    reward.reward_type: math                                         reward.function: math

Placement: `all` becomes `0-(N-1)` over the cluster's N devices; components Tidal has no workers for
(`reward`, `critic`, `env`, `agent`) are taken out of their entries; with no `inference` entry (RLinf then runs
log-probs on the actor) inference joins the actor's entry; node-group (long-form) entries cannot be carried.
Without `cluster.num_gpus_per_node` (newer RLinf detects GPUs) 8 devices per node are assumed, or more if the
placement names higher ids; a note says so. With `auto_scheduler: true`, RLinf's scheduler treats an absent
`use_pre_process_policy` / `use_wait_before_last_iter_policy` as true, and so does the conversion.

The result is a plain mapping for `tidal.core.config.build_config`; `convert` does not validate it (a config whose
essential values could not be carried fails there, with Tidal's own message).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tidal.convert.builder import Builder, Carried, Dropped
from tidal.convert.interpolation import SUPPORTED_RESOLVERS, resolve_interpolations, resolve_lenient
from tidal.convert.mapping import map_keys
from tidal.core.config import (
    ActorConfig,
    AlgorithmConfig,
    ClusterConfig,
    DataConfig,
    InferenceConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SchedulerConfig,
    TidalConfig,
    TrackingConfig,
    WarmStartConfig,
    read_yaml,
)
from tidal.core.errors import ConfigError

__all__ = ["Carried", "Conversion", "Dropped", "SUPPORTED_RESOLVERS", "convert", "convert_file",
           "resolve_interpolations", "to_yaml"]


@dataclass(frozen=True)
class Conversion:
    config: dict                        # plain Tidal config mapping (sections -> keys), for build_config
    dropped: tuple[Dropped, ...]
    carried: tuple[Carried, ...] = ()
    notes: tuple[str, ...] = ()         # values Tidal derived or assumed (placement rewritten, defaults applied)
    source: str | None = None           # file it came from, for the YAML header


def convert(doc: object, *, source: str | None = None) -> Conversion:
    """Map an RLinf experiment mapping (interpolations resolved here) onto a plain Tidal config mapping."""
    field = source or "rlinf config"
    if not isinstance(doc, dict):
        raise ConfigError(field, type(doc).__name__, "top level must be a mapping of sections",
                          "pass an RLinf experiment YAML (cluster:, runner:, algorithm: ... sections)")
    doc = {str(k): v for k, v in doc.items()}
    b = Builder(resolve_lenient(doc, field), field)
    map_keys(b, doc)
    dropped, carried = b.result()
    return Conversion(config=_ordered(b.out), dropped=dropped, carried=carried, notes=tuple(b.notes),
                      source=source)


def convert_file(path: str | Path) -> Conversion:
    """Read an RLinf YAML with `yaml.safe_load` and convert it; `defaults:` files are reported, not followed."""
    doc = read_yaml(path, "rlinf config",
                    "pass the path of an RLinf experiment YAML, e.g. examples/reasoning/config/math/x.yaml")
    return convert(doc, source=str(path))


# ------------------------------------------------------------------------------------------------------- output

#: Tidal's section order, with the sections being added to config.py at their intended places.
_SECTION_MODELS: dict[str, Any] = {
    "run": RunConfig, "cluster": ClusterConfig, "model": ModelConfig, "actor": ActorConfig,
    "rollout": RolloutConfig, "inference": InferenceConfig, "algorithm": AlgorithmConfig, "data": DataConfig,
    "reward": None, "warm_start": WarmStartConfig, "scheduler": SchedulerConfig, "tracking": TrackingConfig,
}
_KEY_ORDER: dict[str, tuple[str, ...]] = {
    "model": ("path",),
    "data": ("train_files", "val_files", "prompt_key", "answer_key", "max_prompt_length", "max_response_length",
             "rollout_batch_size", "shuffle", "apply_chat_template", "seed"),
}


def _section_order() -> list[str]:
    order = list(TidalConfig.model_fields)
    for i, name in enumerate(_SECTION_MODELS):
        if name not in order:
            before = [s for s in list(_SECTION_MODELS)[:i] if s in order]
            order.insert(order.index(before[-1]) + 1 if before else 0, name)
    return order


def _ordered(cfg: dict) -> dict:
    out: dict = {}
    sections = _section_order()
    for name in sorted(cfg, key=lambda s: sections.index(s) if s in sections else len(sections)):
        section = cfg[name]
        model = TidalConfig.model_fields[name].annotation if name in TidalConfig.model_fields else None
        known = list(_KEY_ORDER.get(name, ())) + [k for k in getattr(model, "model_fields", {})
                                                  if k not in _KEY_ORDER.get(name, ())]
        keys = sorted(section, key=lambda k: known.index(k) if k in known else len(known))
        out[name] = {k: (list(section[k]) if isinstance(section[k], tuple) else section[k]) for k in keys}
    return out


def _comment(text: str) -> str:
    return " ".join(str(text).split())


def to_yaml(conv: Conversion, *, with_dropped: bool = True) -> str:
    """The Tidal config as YAML (sections in Tidal's order) under a header naming the source; notes and the keys
    not carried follow as comments, so `yaml.safe_load` of the text gives back `conv.config`."""
    lines = [f"# Tidal config converted from the RLinf config {conv.source or '(a mapping)'}",
             "# by `tidal convert rlinf`. Check the notes and the keys that were not carried."]
    if conv.notes:
        lines.append("# Notes:")
        lines += [f"#   - {_comment(n)}" for n in conv.notes]
    text = "\n".join(lines) + "\n"
    if conv.config:
        text += yaml.safe_dump(_ordered(conv.config), sort_keys=False, default_flow_style=False,
                               allow_unicode=True, width=120)
    else:
        text += "{}\n"
    if with_dropped and conv.dropped:
        text += f"\n# Not carried ({len(conv.dropped)} RLinf keys):\n"
        text += "".join(f"#   {_comment(d.key)}: {_comment(d.reason)}\n" for d in conv.dropped)
    return text

