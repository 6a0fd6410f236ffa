"""The RLinf -> Tidal key mapping: one step per Tidal section, each reading RLinf leaves from the `Builder`,
carrying them (checked and converted) or dropping them with the reason (the table is in `rlinf`'s doc)."""

from __future__ import annotations

import math
from typing import Any

from tidal.convert.builder import ABSENT, Builder, positive
from tidal.convert.interpolation import Unresolved
from tidal.convert.keys import NO_EQUIV, NODE_GROUPS, NULL, exactly
from tidal.core.config import ActorConfig, ClusterConfig, RunConfig
from tidal.core.errors import ConfigError
from tidal.core.placement import COMPONENTS, parse_device_ids

_MODEL_PATHS = ("rollout.model.model_path", "rollout.model_dir", "actor.model.model_path",
                "actor.tokenizer.tokenizer_model", "reward.tokenizer.tokenizer_model",
                "actor.megatron.ckpt_convertor.hf_model_path")
_PRECISION = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
              "32": "float32", 32: "float32", "bf16-mixed": "bfloat16"}
_TOP_K_OFF = 100_000   # RLinf writes "no top-k" as a very large k (its configs use 1000000); Tidal writes 0
_NON_COMPONENT = {"reward": "Tidal scores rewards inside its pipeline (no reward workers to place)",
                  "critic": "GRPO needs no critic"}
_DATA_SUFFIXES = (".jsonl", ".parquet")


def _defaults(b: Builder, defaults: Any) -> None:
    if not isinstance(defaults, list):
        b.drop("defaults[0]", f"`defaults:` is not a list ({defaults!r}); ignored")
        return
    for i, entry in enumerate(defaults):
        key = f"defaults[{i}]"
        if entry == "_self_":
            continue
        if isinstance(entry, dict) and len(entry) == 1:
            group, option = next(iter(entry.items()))
            text = f"{group}: {option}"
            if "hydra/" in str(group):
                b.drop(key, f"Hydra setting `{text}`; not needed by Tidal")
                continue
        else:
            text = str(entry)
        b.drop(key, f"`{text}` names another config file; not followed (copy its keys into this file to carry "
                    f"them)")


def _run(b: Builder) -> None:
    steps = b.take("runner.max_steps")
    steps = b.as_int(steps, "runner.max_steps") if steps not in (ABSENT, None) else steps
    if isinstance(steps, int) and steps > 0:
        b.carry("runner.max_steps", "run.num_steps", steps)
        b.drop("runner.max_epochs", "run.num_steps is taken from runner.max_steps (Tidal counts RL steps)")
    else:
        b.drop("runner.max_steps", "-1/null means 'derive from runner.max_epochs' in RLinf; Tidal counts RL steps: "
                                   "set run.num_steps (Tidal's default was kept)")
        b.drop("runner.max_epochs", "epochs need the dataset size; set run.num_steps to max_epochs x "
                                    "(train prompts / data.rollout_batch_size)")
        if "runner.max_epochs" in b.leaves or "runner.max_steps" in b.leaves:
            b.notes.append("run.num_steps was not derived (RLinf counts epochs); Tidal's default "
                           f"{RunConfig.model_fields['num_steps'].default} applies until you set it")
    b.simple("runner.experiment_name", "run.name", b.as_str)
    b.simple("runner.output_dir", "run.output_dir", b.as_str)
    b.simple("actor.seed", "run.seed", b.as_int)
    b.simple("runner.val_check_interval", "run.eval_every", b.as_int,
             lambda v: None if v >= 1 else "Tidal always evaluates (run.eval_every >= 1)")
    b.simple("runner.save_interval", "run.checkpoint_every", b.as_int,
             lambda v: None if v >= 1 else "use run.checkpoint_every: 0 to checkpoint only at the end")
    b.simple("runner.logger.project_name", "tracking.experiment", b.as_str)
    name = b.out.get("run", {}).get("name")
    logged = b.take("runner.logger.experiment_name")
    if name is not None and logged is not ABSENT and str(logged) == name:
        b.carry("runner.logger.experiment_name", "run.name")


def _cluster(b: Builder) -> None:
    nodes = b.simple("cluster.num_nodes", "cluster.num_nodes", b.as_int, positive)
    nodes = nodes if isinstance(nodes, int) else ClusterConfig.model_fields["num_nodes"].default
    per_node = b.simple("cluster.num_gpus_per_node", "cluster.num_devices_per_node", b.as_int, positive)
    _placement(b, nodes, per_node)
    auto = b.simple("cluster.auto_scheduler", "cluster.auto_scheduler", b.as_bool)
    for flag in ("use_pre_process_policy", "use_wait_before_last_iter_policy"):
        got = b.simple(f"cluster.{flag}", f"cluster.{flag}", b.as_bool)
        if got is ABSENT and auto is True:
            b.put(f"cluster.{flag}", True)
            b.notes.append(f"cluster.{flag} set to true: RLinf's dynamic scheduler defaults it to true when "
                           "auto_scheduler is on and the key is absent")
    b.simple("cluster.preprocess_threshold", "scheduler.pre_process_threshold", b.as_float,
             lambda v: None if 0 < v <= 1 else "Tidal's pre_process_threshold is in (0, 1]")


def _placement(b: Builder, nodes: int, per_node: Any) -> None:
    prefix = "cluster.component_placement"
    raw = b.subtree(prefix)
    if raw is ABSENT:
        return
    if not isinstance(raw, dict):
        b.take(prefix)   # raises if unresolved
        b.drop(prefix, f"value not supported: not a mapping of components to devices ({raw!r})")
        return
    entries = _placement_entries(b, raw, prefix)
    if per_node is ABSENT:
        per_node = _assumed_per_node(b, entries, nodes, prefix)
    placement = _placement_mapping(b, entries, nodes * per_node, prefix)
    placement = _inference_on_actor(b, placement)
    if placement:
        b.put(prefix, placement)


def _placement_entries(b: Builder, raw: dict, prefix: str) -> list[tuple[str, str, list[str], Any]]:
    """The entries Tidal can place, as (rlinf key, leaf key, kept names, spec); the rest, and the components Tidal
    has no role for, dropped with the reason."""
    entries: list[tuple[str, str, list[str], Any]] = []
    for key, spec in raw.items():
        leaf = f"{prefix}.{key}"
        names = [n.strip() for n in str(key).split(",") if n.strip()]
        if isinstance(spec, dict):
            if "node_group" in spec:
                for sub in spec:
                    b.drop(f"{leaf}.{sub}", f"node-group placement cannot be carried: {NODE_GROUPS}")
                continue
            if "placement" not in spec:
                for sub in spec:
                    b.drop(f"{leaf}.{sub}", "value not supported: a long-form entry needs `placement:`")
                continue
            for sub in spec:
                if sub != "placement":
                    b.drop(f"{leaf}.{sub}", NO_EQUIV)
            leaf = f"{leaf}.placement"
            spec = spec["placement"]
        if isinstance(spec, Unresolved):
            raise spec.error
        kept = [n for n in names if n in COMPONENTS]
        removed = [n for n in names if n not in COMPONENTS]
        if removed:
            why = "; ".join(f"{n}: {_NON_COMPONENT.get(n, 'not part of Tidal pipeline (actor, rollout, inference)')}"
                            for n in removed)
            b.drop(leaf, f"component{'s' if len(removed) > 1 else ''} {', '.join(removed)} taken out of this "
                         f"entry ({why})")
        if not kept:
            continue
        if isinstance(spec, str) and ":" in spec:
            b.drop(leaf, "value not supported: node:process rank placement (Tidal places one worker per device)")
            continue
        entries.append((str(key), leaf, kept, spec))
    return entries


def _assumed_per_node(b: Builder, entries: list[tuple[str, str, list[str], Any]], nodes: int, prefix: str) -> int:
    """Devices per node where RLinf's config leaves them to detection: Tidal's default, raised until the highest
    placed id fits; put and noted."""
    highest = -1
    for _, _, _, spec in entries:
        if not (isinstance(spec, str) and spec.strip() == "all"):
            try:
                highest = max(highest, *parse_device_ids(spec, prefix))
            except ConfigError:
                pass
    per_node = ClusterConfig.model_fields["num_devices_per_node"].default
    if highest + 1 > nodes * per_node:
        per_node = math.ceil((highest + 1) / nodes)
    b.put("cluster.num_devices_per_node", per_node)
    b.notes.append(f"cluster.num_devices_per_node: {per_node} assumed (RLinf detects the GPUs of each node; "
                   "cluster.num_gpus_per_node was not set): set it to your nodes' GPU count")
    return per_node


def _placement_mapping(b: Builder, entries: list[tuple[str, str, list[str], Any]], total: int,
                       prefix: str) -> dict[str, Any]:
    """Tidal's placement mapping from the kept entries: `all` spelled as the cluster's `total` devices, a key
    that repeats once components are taken out dropped."""
    placement: dict[str, Any] = {}
    for key, leaf, kept, spec in entries:
        if isinstance(spec, str) and spec.strip() == "all":
            spec = f"0-{total - 1}" if total > 1 else "0"
            b.notes.append(f"placement {key}: all -> {spec!r} (the cluster's {total} devices)")
        new_key = ",".join(kept)
        if new_key in placement:
            b.drop(leaf, f"value not supported: {new_key} is placed twice once other components are taken out")
            continue
        placement[new_key] = spec
        b.carry(leaf, prefix)
    return placement


def _inference_on_actor(b: Builder, placement: dict[str, Any]) -> dict[str, Any]:
    """`placement` with inference added to the actor's entry where no entry places it (RLinf computes log-probs
    on the actor then)."""
    placed = {n for k in placement for n in k.split(",")}
    if placement and "inference" not in placed:
        actor_key = next((k for k in placement if "actor" in k.split(",")), None)
        if actor_key is not None:
            new_key = f"{actor_key},inference"
            placement = {(new_key if k == actor_key else k): v for k, v in placement.items()}
            b.notes.append(f"placement: inference added to the actor's entry ({new_key!r}): with no inference "
                           "component RLinf computes log-probs on the actor; Tidal runs them on its inference "
                           "component, here on the actor's devices")
    return placement


def _model(b: Builder) -> None:
    path_key, path = None, None
    for key in _MODEL_PATHS:
        v = b.take(key)
        if v in (ABSENT, None):
            if v is None:
                b.drop(key, NULL)
            continue
        text = b.as_str(v, key)
        norm = text.rstrip("/") or "/"
        if path is None:
            path_key, path = key, norm
            b.carry(key, "model.path", norm)
        elif norm == path:
            b.carry(key, "model.path")
        else:
            b.drop(key, f"differs from model.path {path!r} (taken from {path_key}); Tidal uses one checkpoint for "
                        "the policy and its tokenizer")
    seq = b.simple("runner.seq_length", "model.max_seq_len", b.as_int)
    for key in ("actor.model.seq_length", "actor.model.encoder_seq_length"):
        v = b.take(key)
        if v is ABSENT:
            continue
        if seq is not ABSENT and v is not None and b.as_int(v, key) == seq:
            b.carry(key, "model.max_seq_len")
        else:
            b.drop(key, "differs from runner.seq_length (carried as model.max_seq_len)")


def _actor(b: Builder) -> None:
    b.simple("actor.model.tensor_model_parallel_size", "actor.tensor_parallel_size", b.as_int, positive)
    _actor_backend(b)
    _actor_precision(b)
    lr = _actor_optimizer(b)
    _actor_lr_schedule(b, lr)
    for kind in ("optimizer", "grad", "weight"):   # used where the actor shares devices with rollout
        b.simple(f"actor.offload_{kind}", f"actor.offload_{kind}", b.as_bool)
    _actor_micro_batch(b)


def _actor_backend(b: Builder) -> None:
    """RLinf's training backend: megatron and native carry, FSDP converts to Tidal's own engine."""
    backend = b.take("actor.training_backend")
    if backend not in (ABSENT, None):
        name = b.as_str(backend, "actor.training_backend").lower()
        if name in ("megatron", "native"):
            b.carry("actor.training_backend", "actor.backend", name)
        elif name == "fsdp":   # an FSDP run converts to Tidal's own engine, the other keys carry as they are
            b.drop("actor.training_backend", "value not supported: RLinf's FSDP actor; Tidal trains it with "
                                             "actor.backend: native (its own TP + ZeRO-1 engine, the default)")
        else:
            raise b.err("actor.training_backend", backend, "is not an actor backend Tidal knows",
                        "use megatron (actor.backend: megatron) or fsdp (converted to actor.backend: native)")


def _actor_precision(b: Builder) -> None:
    """The training dtype: bf16 or fp32 carry, anything else leaves actor.dtype at auto."""
    prec = b.take("actor.model.precision")
    if prec not in (ABSENT, None):
        dtype = _PRECISION.get(prec if isinstance(prec, int) else str(prec).lower())
        if dtype:
            b.carry("actor.model.precision", "actor.dtype", dtype)
        else:
            b.drop("actor.model.precision", f"value not supported: Tidal trains in bf16 or fp32 ({prec!r}; fp16 "
                                            "loss scaling is not implemented); actor.dtype left at auto")


def _actor_optimizer(b: Builder) -> Any:
    """Adam's settings (a beta given alone takes Tidal's default for the other). Returns the LR as carried, or
    ABSENT."""
    lr = b.simple("actor.optim.lr", "actor.lr", b.as_float, lambda v: None if v > 0 else "must be > 0")
    beta1 = b.take("actor.optim.adam_beta1")
    beta2 = b.take("actor.optim.adam_beta2")
    if beta1 not in (ABSENT, None) or beta2 not in (ABSENT, None):
        default = ActorConfig.model_fields["betas"].default
        betas = [b.as_float(beta1, "actor.optim.adam_beta1") if beta1 not in (ABSENT, None) else default[0],
                 b.as_float(beta2, "actor.optim.adam_beta2") if beta2 not in (ABSENT, None) else default[1]]
        b.put("actor.betas", betas)
        for key, v in (("actor.optim.adam_beta1", beta1), ("actor.optim.adam_beta2", beta2)):
            if v not in (ABSENT, None):
                b.carry(key, "actor.betas")
    b.simple("actor.optim.adam_eps", "actor.eps", b.as_float)
    b.simple("actor.optim.weight_decay", "actor.weight_decay", b.as_float)
    b.simple("actor.optim.clip_grad", "actor.grad_clip", b.as_float,
             lambda v: None if v > 0 else "Tidal always clips (actor.grad_clip > 0)")
    return lr


def _actor_lr_schedule(b: Builder, lr: Any) -> None:
    """LR schedule: Tidal warms up linearly, then decays by cosine to lr x min_lr_ratio; `lr` is the carried
    peak (or ABSENT)."""
    b.simple("actor.lr_sched.lr_warmup_iters", "actor.warmup_iters", b.as_int,
             lambda v: None if v >= 0 else "must be >= 0")
    style = b.take("actor.lr_sched.lr_decay_style")
    if style not in (ABSENT, None):
        style = str(style).lower()
        if style == "constant":
            b.carry("actor.lr_sched.lr_decay_style", "actor.min_lr_ratio", 1.0)
        elif style == "cosine" and lr is not ABSENT:
            floor_key = next((k for k in ("actor.lr_sched.min_lr", "actor.optim.min_lr")
                              if b.take(k) not in (ABSENT, None)), None)
            peak = b.take("actor.lr_sched.max_lr")
            peak = lr if peak in (ABSENT, None) else b.as_float(peak, "actor.lr_sched.max_lr")
            if floor_key and peak > 0:
                ratio = round(min(1.0, b.as_float(b.take(floor_key), floor_key) / peak), 12)
                b.carry("actor.lr_sched.lr_decay_style", "actor.min_lr_ratio", ratio)
                b.carry(floor_key, "actor.min_lr_ratio")
        else:
            b.drop("actor.lr_sched.lr_decay_style", f"value not supported: Tidal decays by cosine ({style!r}); "
                                                    "actor.min_lr_ratio left at Tidal's default")
    if style == "constant" or "actor.lr_sched.min_lr" not in {c.key for c in b.carried}:
        b.drop("actor.lr_sched.min_lr", "no Tidal equivalent here (used only with lr_decay_style: cosine)")
    peak = b.take("actor.lr_sched.max_lr")
    if peak not in (ABSENT, None) and lr is not ABSENT:
        if math.isclose(b.as_float(peak, "actor.lr_sched.max_lr"), lr):
            b.carry("actor.lr_sched.max_lr", "actor.lr")
        else:
            b.drop("actor.lr_sched.max_lr", "differs from actor.optim.lr; Tidal has one peak LR (actor.lr, "
                                            "from actor.optim.lr)")


def _actor_micro_batch(b: Builder) -> None:
    """The micro batch: algorithm.training_batch_size_per_gpu, or actor.micro_batch_size where that is absent;
    the two must agree where both are given."""
    micro = b.simple("algorithm.training_batch_size_per_gpu", "actor.micro_batch_size", b.as_int, positive)
    other = b.take("actor.micro_batch_size")
    if other not in (ABSENT, None):
        if micro is ABSENT:
            b.simple("actor.micro_batch_size", "actor.micro_batch_size", b.as_int, positive)
        elif b.as_int(other, "actor.micro_batch_size") == micro:
            b.carry("actor.micro_batch_size", "actor.micro_batch_size")
        else:
            b.drop("actor.micro_batch_size", "differs from algorithm.training_batch_size_per_gpu (carried as "
                                             "actor.micro_batch_size)")


def _rollout(b: Builder) -> None:
    sp = "algorithm.sampling_params"
    greedy_key = next((k for k, greedy in ((f"{sp}.use_greedy", True), (f"{sp}.do_sample", False))
                       if exactly(b.take(k), greedy)), None)
    if greedy_key:
        b.carry(greedy_key, "rollout.temperature", 0.0)
        b.drop(f"{sp}.temperature", f"overridden: greedy decoding ({greedy_key.rsplit('.', 1)[1]}) is "
                                    "rollout.temperature: 0")
    else:
        b.simple(f"{sp}.temperature", "rollout.temperature", b.as_float,
                 lambda v: None if v >= 0 else "must be >= 0")
    b.simple(f"{sp}.top_p", "rollout.top_p", b.as_float, lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    top_k = b.take(f"{sp}.top_k")
    if top_k not in (ABSENT, None):
        k = b.as_int(top_k, f"{sp}.top_k")
        if k < 0 or k >= _TOP_K_OFF:
            b.carry(f"{sp}.top_k", "rollout.top_k", 0)
            b.notes.append(f"rollout.top_k: 0 (top-k off) for RLinf's top_k: {k} (a 'very large' or negative k "
                           "disables top-k)")
        else:
            b.carry(f"{sp}.top_k", "rollout.top_k", k)
    b.simple(f"{sp}.max_new_tokens", "rollout.max_new_tokens", b.as_int, positive)
    b.simple("rollout.tensor_parallel_size", "rollout.tensor_parallel_size", b.as_int, positive)
    b.simple("rollout.max_running_requests", "rollout.max_running_requests", b.as_int, positive)
    b.simple("rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", b.as_float,
             lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    backend = b.take("rollout.rollout_backend")
    if backend not in (ABSENT, None):
        if str(backend).lower() == "vllm":
            b.carry("rollout.rollout_backend", "rollout.backend", "vllm")
        else:
            b.drop("rollout.rollout_backend", f"value not supported: Tidal's rollout backends are native and vllm "
                                              f"({backend!r}); rollout.backend left at Tidal's default")


def _inference(b: Builder) -> None:
    b.simple("inference.model.tensor_model_parallel_size", "inference.tensor_parallel_size", b.as_int, positive)
    if b.take("algorithm.logprob_forward_micro_batch_size") not in (ABSENT, None):
        b.drop("algorithm.logprob_forward_micro_batch_size", "Tidal scores each group as one batch of group_size "
                                                             "sequences, so its log-probs do not depend on which "
                                                             "groups arrive together")


def _algorithm(b: Builder) -> None:
    b.simple("algorithm.group_size", "algorithm.group_size", b.as_int, positive)
    b.simple("algorithm.n_minibatches", "algorithm.n_minibatches", b.as_int, positive)
    b.simple("algorithm.ratio_clip_eps", "algorithm.clip_eps", b.as_float, lambda v: None if v > 0 else "must be > 0")
    b.simple("algorithm.kl_beta", "algorithm.kl_coef", b.as_float, lambda v: None if v >= 0 else "must be >= 0")
    adv = b.take("algorithm.adv_type")
    if adv not in (ABSENT, None):
        if str(adv).lower() in ("grpo", "grpo-math", "grpo_math"):
            b.carry("algorithm.adv_type", "algorithm.name", "grpo")
        else:
            b.drop("algorithm.adv_type", f"value not supported: Tidal runs GRPO only ({adv!r})")
            b.notes.append(f"algorithm: RLinf's adv_type {adv!r} has no Tidal equivalent; the converted run is GRPO")


def _data(b: Builder) -> None:
    for src, target in (("data.train_data_paths", "data.train_files"), ("data.val_data_paths", "data.val_files")):
        v = b.take(src)
        if v in (ABSENT, None):
            if v is None:
                b.drop(src, NULL)
            continue
        paths = [b.as_str(p, src) for p in (v if isinstance(v, list) else [v])]
        ok = [p for p in paths if p.lower().endswith(_DATA_SUFFIXES)]
        bad = [p for p in paths if p not in ok]
        if bad:
            b.drop(src, f"value not supported: Tidal reads .jsonl and .parquet files, not {', '.join(bad)} "
                        "(convert them to .jsonl)")
        if ok:
            b.carry(src, target, ok)
    b.simple("data.prompt_key", "data.prompt_key", b.as_str)
    b.simple("data.answer_key", "data.answer_key", b.as_str)
    b.simple("data.max_prompt_length", "data.max_prompt_length", b.as_int, positive)
    b.simple("data.rollout_batch_size", "data.rollout_batch_size", b.as_int, positive)
    b.simple("data.shuffle", "data.shuffle", b.as_bool)
    b.simple("data.apply_chat_template", "data.apply_chat_template", b.as_bool)
    b.simple("data.seed", "data.seed", b.as_int)
    key = "data.filter_prompt_by_length"
    v = b.take(key)
    if v not in (ABSENT, None):
        if b.as_bool(v, key):
            b.carry(key, "data.truncation", "filter")
        else:
            b.drop(key, "value not supported: RLinf then cuts over-long prompts to max_prompt_length; Tidal drops "
                        "them (data.truncation: filter, its default) or stops the run (error)")
    key = "data.apply_chat_template_kwargs"
    kwargs = b.subtree(key)
    if isinstance(kwargs, dict):
        leaves = [k for k in b.leaves if k == key or k.startswith(key + ".")]
        for k in leaves:
            b.take(k)   # raises if one did not resolve
        b.put("data.chat_template_kwargs", kwargs)
        for k in leaves:
            b.carry(k, "data.chat_template_kwargs")


def _reward(b: Builder) -> None:
    kind = b.take("reward.reward_type")
    if kind not in (ABSENT, None):
        if str(kind).lower() == "math":
            b.carry("reward.reward_type", "reward.function", "math")
        else:
            b.drop("reward.reward_type", f"value not supported: Tidal's built-in rewards are gsm8k, math and exact "
                                         f"({kind!r}); set reward.function (e.g. module.path:function)")


def map_keys(b: Builder, doc: dict) -> None:
    """Run every step over `b`; `doc` is the raw mapping (its `defaults:` list is reported, not followed)."""
    if "defaults" in doc:
        _defaults(b, doc["defaults"])
    for step in (_run, _cluster, _model, _actor, _rollout, _inference, _algorithm, _data, _reward):
        step(b)
