"""`tidal convert rlinf FILE`: turn an RLinf experiment YAML into a Tidal config, saying what was not carried.

RLinf (github.com/RLinf/RLinf) configs are Hydra/OmegaConf files: a `defaults:` list, `${a.b}` references,
resolvers such as `${oc.env:VAR,default}` and RLinf's own `${subtract:x,y}`. This module reads them with
`yaml.safe_load` only (no OmegaConf, no Hydra), resolves the interpolations itself, maps every key that has a
Tidal equivalent and lists every other leaf key in `Conversion.dropped` with the reason.

Interpolations (`resolve_interpolations`):

    ${a.b.c}  ${a.b[0]}      absolute reference; a whole-string reference keeps the value's type (int stays int,
                             a mapping stays a mapping); inside a longer string it is concatenated as text
    ${.x}  ${..x}            relative reference (OmegaConf's): `.` is the mapping holding the key, each further
                             dot one level up
    ${oc.env:VAR}            environment variable, as text; `${oc.env:VAR,default}` falls back to `default`
                             (text, or None for null); unset without a default is an error
    ${oc.select:key,default} reference that falls back to `default` when `key` is not set
    ${oc.decode:text}        text parsed as a YAML-like primitive (int, float, bool, null)
    ${subtract:x,y} ${multiply:x,y} ${int_div:x,y} ${not:x}     the resolvers RLinf registers
    \\${...}                  escaped: the literal text ${...}

Nesting works anywhere (`${subtract:${runner.seq_length}, ${data.max_prompt_length}}`, `${a.${b}}`). A missing
key, a cycle, an unset environment variable or any other resolver (`${eval:...}`, `${hydra:...}`) is a
`ConfigError` naming the reference and the key that holds it. `convert` resolves leniently: a leaf that cannot
be resolved is only an error when Tidal needs its value; otherwise it is listed as dropped with the cause.

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
    actor.optim.lr, adam_beta1/adam_beta2, adam_eps, weight_decay,   actor.lr, betas, eps, weight_decay, grad_clip
      clip_grad
    actor.lr_sched.lr_warmup_iters, lr_decay_style (+ min_lr)        actor.warmup_iters, min_lr_ratio
    algorithm.training_batch_size_per_gpu (or actor.micro_batch_size)    actor.micro_batch_size
    algorithm.sampling_params.temperature, top_p, top_k,             rollout.temperature, top_p, top_k,
      max_new_tokens, use_greedy / do_sample                         max_new_tokens (greedy -> temperature 0)
    rollout.tensor_parallel_size, max_running_requests, rollout_backend: vllm    rollout.*, rollout.backend
    inference.model.tensor_model_parallel_size;                      inference.tensor_parallel_size;
      algorithm.logprob_forward_micro_batch_size                     inference.micro_batch_size
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

The result is a plain mapping for `tidal.config.build_config`; `convert` does not validate it (a config whose
essential values could not be carried fails there, with Tidal's own message).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from tidal.config import (ActorConfig, AlgorithmConfig, ClusterConfig, DataConfig, InferenceConfig, ModelConfig,
                          RolloutConfig, RunConfig, SchedulerConfig, TidalConfig, TrackingConfig, WarmStartConfig)
from tidal.errors import ConfigError
from tidal.placement import COMPONENTS, parse_device_ids


@dataclass(frozen=True)
class Dropped:
    key: str       # dotted RLinf key (`defaults[1]` for a defaults-list entry)
    reason: str    # why it could not be carried


@dataclass(frozen=True)
class Carried:
    key: str       # dotted RLinf key
    target: str    # dotted Tidal key it was carried to


@dataclass(frozen=True)
class Conversion:
    config: dict                        # plain Tidal config mapping (sections -> keys), for build_config
    dropped: tuple[Dropped, ...]
    carried: tuple[Carried, ...] = ()
    notes: tuple[str, ...] = ()         # values Tidal derived or assumed (placement rewritten, defaults applied)
    source: str | None = None           # file it came from, for the YAML header


# ----------------------------------------------------------------------------------------------- interpolation


class _Ref:
    def __init__(self, key: list, text: str):
        self.key, self.text = key, text


class _Call:
    def __init__(self, name: str, args: list[list], text: str):
        self.name, self.args, self.text = name, args, text


class _Quoted:
    def __init__(self, parts: list):
        self.parts = parts


_RESOLVER_HEAD = re.compile(r"\s*([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*)\s*:")
_INT = re.compile(r"[+-]?\d+(?:_\d+)*")
_FLOAT = re.compile(r"[+-]?(?:\d+(?:_\d+)*\.\d*|\.\d+|\d+(?:_\d+)*)(?:[eE][+-]?\d+)?|[+-]?(?:inf|nan)", re.I)


class _Parser:
    """OmegaConf's interpolation grammar, the part RLinf configs use: `${key}`, `${resolver:arg,...}`, nesting."""

    def __init__(self, text: str, error: Callable[[str, str], ConfigError]):
        self.s, self.i, self.error = text, 0, error

    def parse(self) -> list:
        parts = self.sequence("")
        return parts

    def sequence(self, stops: str) -> list:
        s, parts, buf = self.s, [], []
        while self.i < len(s):
            if s.startswith("\\${", self.i):
                buf.append("${")
                self.i += 3
            elif s.startswith("${", self.i):
                if buf:
                    parts.append("".join(buf))
                    buf = []
                parts.append(self.interpolation())
            elif s[self.i] in stops:
                break
            else:
                buf.append(s[self.i])
                self.i += 1
        if buf:
            parts.append("".join(buf))
        return parts

    def interpolation(self) -> _Ref | _Call:
        start = self.i
        self.i += 2
        head = _RESOLVER_HEAD.match(self.s, self.i)
        if head:
            self.i = head.end()
            args = self.arguments(start)
            return _Call(head.group(1), args, self.s[start:self.i])
        key = self.sequence("}")
        if self.i >= len(self.s):
            raise self.error(self.s[start:], "is an unterminated interpolation (no closing '}')")
        self.i += 1
        return _Ref(key, self.s[start:self.i])

    def arguments(self, start: int) -> list[list]:
        self.skip_space()
        if self.s.startswith("}", self.i):
            self.i += 1
            return []
        args = []
        while True:
            args.append(self.argument(start))
            if self.i >= len(self.s):
                raise self.error(self.s[start:], "is an unterminated interpolation (no closing '}')")
            c = self.s[self.i]
            self.i += 1
            if c == "}":
                return args
            if c != ",":
                raise self.error(self.s[start:], f"has {c!r} after a quoted argument (expected ',' or '}}')")

    def argument(self, start: int) -> list:
        self.skip_space()
        if self.i < len(self.s) and self.s[self.i] in "'\"":
            quote, j, buf = self.s[self.i], self.i + 1, []
            while j < len(self.s) and self.s[j] != quote:
                if self.s[j] == "\\" and j + 1 < len(self.s) and self.s[j + 1] in (quote, "\\"):
                    j += 1
                buf.append(self.s[j])
                j += 1
            if j >= len(self.s):
                raise self.error(self.s[start:], "has an unterminated quoted argument")
            self.i = j + 1
            self.skip_space()
            return [_Quoted(_Parser("".join(buf), self.error).parse())]
        parts = self.sequence(",}")
        if parts and isinstance(parts[-1], str):
            parts[-1] = parts[-1].rstrip()
            if not parts[-1]:
                parts.pop()
        return parts

    def skip_space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t":
            self.i += 1


def _primitive(text: str) -> Any:
    """An unquoted resolver argument, typed as OmegaConf types it."""
    t = text.strip()
    low = t.lower()
    if low == "null":
        return None
    if low in ("true", "false"):
        return low == "true"
    if _INT.fullmatch(t):
        return int(t.replace("_", ""))
    if _FLOAT.fullmatch(t):
        return float(t.replace("_", ""))
    return t


def _dotted(path: tuple) -> str:
    out = ""
    for seg in path:
        if isinstance(seg, int):
            out += f"[{seg}]"
        else:
            out += f".{seg}" if out else str(seg)
    return out or "<root>"


class _Unresolved:
    """A leaf whose interpolation failed; `convert` raises `error` only if Tidal needs the value."""

    def __init__(self, error: ConfigError):
        self.error = error

    def __repr__(self) -> str:
        return f"<unresolved: {self.error.problem}>"


_ABSENT = object()
_ARITH = {"subtract": lambda x, y: x - y, "multiply": lambda x, y: x * y, "int_div": lambda x, y: x // y}
SUPPORTED_RESOLVERS = ("oc.env", "oc.select", "oc.decode", *_ARITH, "not")


class _Resolver:
    def __init__(self, doc: dict, field: str):
        self.doc, self.field = doc, field
        self.done: dict[tuple, Any] = {}
        self.stack: list[tuple] = []

    def err(self, path: tuple, value: object, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.field}: {_dotted(path)}", value, problem, fix)

    # -- values

    def at(self, path: tuple) -> Any:
        """Resolved value of the raw node at `path` (keys exactly as in the document)."""
        if path in self.done:
            return self.done[path]
        if path in self.stack:
            chain = " -> ".join(_dotted(p) for p in self.stack[self.stack.index(path):] + [path])
            raise self.err(path, self._raw(path), f"is part of an interpolation cycle: {chain}",
                           "break the cycle: give one of these keys a plain value")
        raw = self._raw(path)
        self.stack.append(path)
        try:
            if isinstance(raw, dict):
                value: Any = {k: self.at(path + (k,)) for k in raw}
            elif isinstance(raw, list):
                value = [self.at(path + (i,)) for i in range(len(raw))]
            elif isinstance(raw, str) and "${" in raw:
                value = self.string(raw, path)
            else:
                value = raw
        finally:
            self.stack.pop()
        self.done[path] = value
        return value

    def _raw(self, path: tuple) -> Any:
        node: Any = self.doc
        for seg in path:
            node = node[seg]
        return node

    def string(self, text: str, path: tuple) -> Any:
        def error(value: str, problem: str) -> ConfigError:
            return self.err(path, value, problem, "write interpolations as ${a.b} or ${resolver:arg,...}")

        parts = _Parser(text, error).parse()
        if len(parts) == 1 and not isinstance(parts[0], str):
            return self.evaluate(parts[0], path)
        return "".join(self.text_of(p, path) for p in parts)

    def text_of(self, part: Any, path: tuple) -> str:
        if isinstance(part, str):
            return part
        if isinstance(part, _Quoted):
            return "".join(self.text_of(p, path) for p in part.parts)
        return str(self.evaluate(part, path))

    def evaluate(self, node: Any, path: tuple) -> Any:
        if isinstance(node, _Ref):
            key = "".join(self.text_of(p, path) for p in node.key).strip()
            return self.reference(key, node.text, path)
        args = [self.argument(a, path) for a in node.args]
        return self.call(node.name, args, node.text, path)

    def argument(self, parts: list, path: tuple) -> Any:
        if not parts:
            return ""
        if len(parts) == 1 and isinstance(parts[0], _Quoted):
            return self.text_of(parts[0], path)
        if len(parts) == 1 and not isinstance(parts[0], str):
            return self.evaluate(parts[0], path)
        if all(isinstance(p, str) for p in parts):
            return _primitive("".join(parts))
        return "".join(self.text_of(p, path) for p in parts).strip()

    # -- references

    def segments(self, key: str, text: str, path: tuple) -> list:
        dots = len(key) - len(key.lstrip("."))
        rest = key[dots:]
        if not rest:
            raise self.err(path, text, "is an empty reference", "name a key, e.g. ${actor.model.precision}")
        segs: list = [s for s in re.split(r"\.|\[|\]", rest) if s != ""]
        if dots:
            base = list(path[:-1])
            if dots - 1 > len(base):
                raise self.err(path, text, "is a relative reference that climbs above the top of the file",
                               "use fewer leading dots, or an absolute reference ${a.b}")
            segs = base[:len(base) - (dots - 1)] + segs
        return segs

    def reference(self, key: str, text: str, path: tuple, default: Any = _ABSENT) -> Any:
        segs = self.segments(key, text, path)
        norm: list = []
        node: Any = self.doc
        raw = True
        for seg in segs:
            if raw and isinstance(node, str) and "${" in node:
                node, raw = self.at(tuple(norm)), False
            found: Any = _ABSENT
            if isinstance(node, dict):
                if seg in node:
                    found = seg
                elif isinstance(seg, str) and _INT.fullmatch(seg) and int(seg) in node:
                    found = int(seg)
            elif isinstance(node, list) and (isinstance(seg, int) or _INT.fullmatch(str(seg))):
                idx = int(seg)
                if -len(node) <= idx < len(node):
                    found = idx
            if found is _ABSENT:
                if default is not _ABSENT:
                    return default
                where = _dotted(tuple(norm)) if norm else "the top level"
                raise self.err(path, text, f"references {'.'.join(map(str, segs))!r}, which is not set "
                                           f"({seg!r} is not a key of {where})",
                               "define that key, or replace the reference with a value")
            norm.append(found)
            node = node[found]
        if raw:
            value = self.at(tuple(norm))
        else:
            value = node
        if value == "???":
            raise self.err(path, text, f"references {'.'.join(map(str, segs))!r}, whose value is '???' (mandatory, "
                                       "not given)", "give that key a value")
        return value

    # -- resolvers

    def call(self, name: str, args: list, text: str, path: tuple) -> Any:
        if name == "oc.env":
            if not 1 <= len(args) <= 2:
                raise self.err(path, text, "oc.env takes a variable name and an optional default",
                               "write ${oc.env:VAR} or ${oc.env:VAR,default}")
            var = str(args[0])
            if var in os.environ:
                return os.environ[var]
            if len(args) == 2:
                return None if args[1] is None else str(args[1])
            raise self.err(path, text, f"environment variable {var} is not set and has no default",
                           f"export {var}=..., or write ${{oc.env:{var},default}}")
        if name == "oc.select":
            if not 1 <= len(args) <= 2:
                raise self.err(path, text, "oc.select takes a key and an optional default",
                               "write ${oc.select:a.b,default}")
            return self.reference(str(args[0]), text, path, default=args[1] if len(args) == 2 else None)
        if name == "oc.decode":
            if len(args) != 1:
                raise self.err(path, text, "oc.decode takes one argument", "write ${oc.decode:${oc.env:VAR}}")
            return _primitive(args[0]) if isinstance(args[0], str) else args[0]
        if name in _ARITH:
            if len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args):
                raise self.err(path, text, f"{name} needs two numbers (got {args!r})",
                               f"write ${{{name}:x,y}} with numbers or references to numbers")
            try:
                return _ARITH[name](*args)
            except ZeroDivisionError:
                raise self.err(path, text, f"{name} divides by zero", "use a non-zero divisor") from None
        if name == "not":
            if len(args) != 1:
                raise self.err(path, text, "not takes one argument", "write ${not:${a.b}}")
            return not bool(args[0])
        raise self.err(path, text, f"uses resolver {name!r}, which the converter does not evaluate "
                                   f"(supported: {', '.join(SUPPORTED_RESOLVERS)})",
                       "replace this interpolation with its value")


def resolve_interpolations(doc: dict, field: str = "rlinf config") -> dict:
    """`doc` with every `${...}` resolved (see the module doc). Raises ConfigError naming the reference."""
    if not isinstance(doc, dict):
        raise ConfigError(field, type(doc).__name__, "top level must be a mapping of sections",
                          "pass an RLinf experiment YAML (cluster:, runner:, algorithm: ... sections)")
    return _Resolver(doc, field).at(())


def _resolve_lenient(doc: dict, field: str) -> dict:
    """Like resolve_interpolations, but a failing leaf becomes an `_Unresolved` in place of raising."""
    r = _Resolver(doc, field)

    def walk(node: dict, path: tuple) -> dict:
        out = {}
        for k, v in node.items():
            if isinstance(v, dict):
                out[k] = walk(v, path + (k,))
                continue
            try:
                out[k] = r.at(path + (k,))
            except ConfigError as e:
                out[k] = _Unresolved(e)
        return out

    return walk(doc, ())


# ------------------------------------------------------------------------------------------------- conversion

_MEGATRON = "Megatron-LM setting; Tidal's actor is its own engine"
_FSDP = "FSDP setting; Tidal's actor is its own engine"
_ENGINE = "SGLang/vLLM engine setting; no Tidal equivalent"
_HYDRA = "Hydra runtime setting; Tidal configs are plain YAML, not launched through Hydra"
_LOGGER = "RLinf logger setting; Tidal tracks runs in MLflow (tracking.*)"
_GROUP = "Ray worker-group name; Tidal names its workers itself"
_TOKENIZER = "tokenizer option; Tidal loads the tokenizer from model.path"
_ARCH = "architecture tag; Tidal reads the architecture from model.path's config.json"
_DYN = "RLinf dynamic-scheduler knob; Tidal's scheduler (scheduler.*) has no equivalent"
_NODE_GROUPS = ("heterogeneous node groups are not supported: Tidal's devices are cluster.num_nodes x "
                "cluster.num_devices_per_node")
_NULL = "null (not set): Tidal's default applies"
_NO_EQUIV = "no Tidal equivalent"

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
    ("actor.training_backend", "Tidal's actor is its own engine (no megatron/fsdp choice)"),
    ("actor.mcore_gpt", _MEGATRON), ("actor.spec_name", _MEGATRON),
    ("actor.checkpoint_load_path", "Megatron checkpoint; Tidal starts from the Hugging Face checkpoint in model.path"),
    ("actor.offload_*", "Tidal does not offload actor state between phases"),
    ("actor.enable_offload", "Tidal does not offload actor state between phases"),
    ("actor.enable_dp_load_balance", _NO_EQUIV), ("actor.calculate_flops", _NO_EQUIV),
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
    ("inference.load_from_actor", _NO_EQUIV),
    ("inference.model.*", _MEGATRON),
    ("algorithm.sampling_params.min_new_tokens", _NO_EQUIV),
    ("algorithm.rollout_batch_size_per_gpu", "Tidal spreads a step's prompts over the rollout instances itself"),
    ("algorithm.val_rollout_batch_size_per_gpu", _NO_EQUIV),
    ("data.val_rollout_batch_size", _NO_EQUIV),
    ("data.type", "RLinf dataset class; Tidal reads data.train_files (.jsonl/.parquet) directly"),
    ("data.dataset_name", "RLinf dataset name; Tidal reads data.train_files directly"),
    ("data.num_workers", _NO_EQUIV), ("data.validation_shuffle", _NO_EQUIV),
    ("reward.reward_scale", "Tidal's rewards are the reward function's values, unscaled"),
    ("cluster.node_groups*", _NODE_GROUPS),
    ("cluster.nsight*", "Nsight profiling wrapper; no Tidal equivalent"),
    ("cluster.assign_policy", _DYN), ("cluster.migrate_out_max_bs", _DYN), ("cluster.monitor_interval", _DYN),
    ("cluster.rollout_use_all_gpus", _DYN), ("cluster.recreate_nccl_groups", _DYN),
    ("cluster.fuse_rollout_inference_only", _DYN),
)


def _is(value: Any, *options: Any) -> bool:
    return any(value == o and type(value) is type(o) for o in options)


def _matches(desc: str) -> Callable[[Any], str]:
    return lambda v: f"matches Tidal's behaviour: {desc}"


def _by_value(ok: Callable[[Any], bool], desc: str, bad: str) -> Callable[[Any], str]:
    return lambda v: f"matches Tidal's behaviour: {desc}" if ok(v) else f"value not supported: {bad}"


_ONE = (lambda v: _is(v, 1))
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

_MODEL_PATHS = ("rollout.model.model_path", "rollout.model_dir", "actor.model.model_path",
                "actor.tokenizer.tokenizer_model", "reward.tokenizer.tokenizer_model",
                "actor.megatron.ckpt_convertor.hf_model_path")
_PRECISION = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
              "32": "float32", 32: "float32", "bf16-mixed": "bfloat16"}
_TOP_K_OFF = 100_000   # RLinf writes "no top-k" as a very large k (its configs use 1000000); Tidal writes 0
_NON_COMPONENT = {"reward": "Tidal scores rewards inside its pipeline (no reward workers to place)",
                  "critic": "GRPO needs no critic"}
_DATA_SUFFIXES = (".jsonl", ".parquet")


def _leaves(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_leaves(v, key))
        else:
            out[key] = v
    return out


def _reason(key: str, value: Any) -> str:
    if key in _BY_VALUE:
        return _BY_VALUE[key](value)
    return _pattern_reason(key)


def _pattern_reason(key: str) -> str:
    for pattern, reason in _REASONS:
        if _glob(pattern, key):
            return reason
    return _NO_EQUIV


def _glob(pattern: str, key: str) -> bool:
    rx = "".join(".*" if c == "*" else re.escape(c) for c in pattern)
    return re.fullmatch(rx, key) is not None


class _Builder:
    def __init__(self, resolved: dict, field: str):
        self.tree, self.field = resolved, field
        self.leaves = _leaves({k: v for k, v in resolved.items() if k != "defaults"})
        self.out: dict[str, dict] = {}
        self.carried: list[Carried] = []
        self.reasons: dict[str, str] = {}
        self.notes: list[str] = []

    # -- reading

    def take(self, key: str) -> Any:
        """The leaf's value, _ABSENT if the key is not there; raises if Tidal needs it and it did not resolve."""
        if key not in self.leaves:
            return _ABSENT
        v = self.leaves[key]
        if isinstance(v, _Unresolved):
            raise v.error
        return v

    def subtree(self, key: str) -> Any:
        node: Any = self.tree
        for seg in key.split("."):
            if not isinstance(node, dict) or seg not in node:
                return _ABSENT
            node = node[seg]
        return node

    def err(self, key: str, value: Any, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.field}: {key}", value, problem, fix)

    def as_int(self, v: Any, key: str) -> int:
        if isinstance(v, bool):
            raise self.err(key, v, "must be an integer", "write a whole number")
        if isinstance(v, int):
            return v
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, str) and _INT.fullmatch(v.strip()):
            return int(v.strip().replace("_", ""))
        raise self.err(key, v, "must be an integer", "write a whole number")

    def as_float(self, v: Any, key: str) -> float:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, str) and _FLOAT.fullmatch(v.strip()):   # yaml.safe_load reads 2e-05 as text
            return float(v.strip().replace("_", ""))
        raise self.err(key, v, "must be a number", "write a number such as 2.0e-05")

    def as_bool(self, v: Any, key: str) -> bool:
        if isinstance(v, bool):
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise self.err(key, v, "must be true or false", "write true or false")

    def as_str(self, v: Any, key: str) -> str:
        if isinstance(v, (dict, list)) or v is None:
            raise self.err(key, v, "must be text", "write a plain string")
        return str(v)

    # -- writing

    def put(self, target: str, value: Any) -> None:
        section, name = target.split(".", 1)
        self.out.setdefault(section, {})[name] = value

    def carry(self, key: str, target: str, value: Any = _ABSENT) -> None:
        if value is not _ABSENT:
            self.put(target, value)
        self.carried.append(Carried(key, target))

    def drop(self, key: str, reason: str) -> None:
        if key in self.leaves or key.startswith("defaults["):
            self.reasons.setdefault(key, reason)

    def simple(self, key: str, target: str, conv: Callable[[Any, str], Any],
               check: Callable[[Any], str | None] | None = None) -> Any:
        """Carry `key` to `target` through `conv`; null is dropped; `check` may refuse a value (returns why)."""
        v = self.take(key)
        if v is _ABSENT:
            return _ABSENT
        if v is None:
            self.drop(key, _NULL)
            return _ABSENT
        value = conv(v, key)
        why = check(value) if check else None
        if why:
            self.drop(key, f"value not supported: {why}")
            return _ABSENT
        self.carry(key, target, value)
        return value

    def result(self) -> tuple[tuple[Dropped, ...], tuple[Carried, ...]]:
        carried_keys = {c.key for c in self.carried}
        dropped = [Dropped(k, r) for k, r in self.reasons.items() if k.startswith("defaults[")]
        for key, value in self.leaves.items():
            if key in self.reasons:
                dropped.append(Dropped(key, self.reasons[key]))
            elif key not in carried_keys:
                if isinstance(value, _Unresolved):
                    dropped.append(Dropped(key, f"could not be resolved ({value.error.problem}); "
                                                f"{_pattern_reason(key)}"))
                else:
                    dropped.append(Dropped(key, _reason(key, value)))
        order = {k: i for i, k in enumerate(self.leaves)}
        carried = sorted(self.carried, key=lambda c: order.get(c.key, len(order)))
        return tuple(dropped), tuple(carried)


def _positive(v: Any) -> str | None:
    return None if v >= 1 else "Tidal needs a value of at least 1"


def _defaults(b: _Builder, defaults: Any) -> None:
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


def _run(b: _Builder) -> None:
    steps = b.take("runner.max_steps")
    steps = b.as_int(steps, "runner.max_steps") if steps not in (_ABSENT, None) else steps
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
    if name is not None and logged is not _ABSENT and str(logged) == name:
        b.carry("runner.logger.experiment_name", "run.name")


def _cluster(b: _Builder) -> None:
    nodes = b.simple("cluster.num_nodes", "cluster.num_nodes", b.as_int, _positive)
    nodes = nodes if isinstance(nodes, int) else ClusterConfig.model_fields["num_nodes"].default
    per_node = b.simple("cluster.num_gpus_per_node", "cluster.num_devices_per_node", b.as_int, _positive)
    _placement(b, nodes, per_node)
    auto = b.simple("cluster.auto_scheduler", "cluster.auto_scheduler", b.as_bool)
    for flag in ("use_pre_process_policy", "use_wait_before_last_iter_policy"):
        got = b.simple(f"cluster.{flag}", f"cluster.{flag}", b.as_bool)
        if got is _ABSENT and auto is True:
            b.put(f"cluster.{flag}", True)
            b.notes.append(f"cluster.{flag} set to true: RLinf's dynamic scheduler defaults it to true when "
                           "auto_scheduler is on and the key is absent")
    b.simple("cluster.preprocess_threshold", "scheduler.pre_process_threshold", b.as_float,
             lambda v: None if 0 < v <= 1 else "Tidal's pre_process_threshold is in (0, 1]")


def _placement(b: _Builder, nodes: int, per_node: Any) -> None:
    prefix = "cluster.component_placement"
    raw = b.subtree(prefix)
    if raw is _ABSENT:
        return
    if not isinstance(raw, dict):
        b.take(prefix)   # raises if unresolved
        b.drop(prefix, f"value not supported: not a mapping of components to devices ({raw!r})")
        return
    entries: list[tuple[str, str, list[str], Any]] = []   # (rlinf key, leaf key, kept names, spec)
    for key, spec in raw.items():
        leaf = f"{prefix}.{key}"
        names = [n.strip() for n in str(key).split(",") if n.strip()]
        if isinstance(spec, dict):
            if "node_group" in spec:
                for sub in spec:
                    b.drop(f"{leaf}.{sub}", f"node-group placement cannot be carried: {_NODE_GROUPS}")
                continue
            if "placement" not in spec:
                for sub in spec:
                    b.drop(f"{leaf}.{sub}", "value not supported: a long-form entry needs `placement:`")
                continue
            for sub in spec:
                if sub != "placement":
                    b.drop(f"{leaf}.{sub}", _NO_EQUIV)
            leaf = f"{leaf}.placement"
            spec = spec["placement"]
        if isinstance(spec, _Unresolved):
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
    if per_node is _ABSENT:
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
    total = nodes * per_node
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
    placed = {n for k in placement for n in k.split(",")}
    if placement and "inference" not in placed:
        actor_key = next((k for k in placement if "actor" in k.split(",")), None)
        if actor_key is not None:
            new_key = f"{actor_key},inference"
            placement = {(new_key if k == actor_key else k): v for k, v in placement.items()}
            b.notes.append(f"placement: inference added to the actor's entry ({new_key!r}): with no inference "
                           "component RLinf computes log-probs on the actor; Tidal runs them on its inference "
                           "component, here on the actor's devices")
    if placement:
        b.put(prefix, placement)


def _model(b: _Builder) -> None:
    path_key, path = None, None
    for key in _MODEL_PATHS:
        v = b.take(key)
        if v in (_ABSENT, None):
            if v is None:
                b.drop(key, _NULL)
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
        if v is _ABSENT:
            continue
        if seq is not _ABSENT and v is not None and b.as_int(v, key) == seq:
            b.carry(key, "model.max_seq_len")
        else:
            b.drop(key, "differs from runner.seq_length (carried as model.max_seq_len)")


def _actor(b: _Builder) -> None:
    b.simple("actor.model.tensor_model_parallel_size", "actor.tensor_parallel_size", b.as_int, _positive)
    prec = b.take("actor.model.precision")
    if prec not in (_ABSENT, None):
        dtype = _PRECISION.get(prec if isinstance(prec, int) else str(prec).lower())
        if dtype:
            b.carry("actor.model.precision", "actor.dtype", dtype)
        else:
            b.drop("actor.model.precision", f"value not supported: Tidal trains in bf16 or fp32 ({prec!r}; fp16 "
                                            "loss scaling is not implemented); actor.dtype left at auto")
    lr = b.simple("actor.optim.lr", "actor.lr", b.as_float, lambda v: None if v > 0 else "must be > 0")
    beta1 = b.take("actor.optim.adam_beta1")
    beta2 = b.take("actor.optim.adam_beta2")
    if beta1 not in (_ABSENT, None) or beta2 not in (_ABSENT, None):
        default = ActorConfig.model_fields["betas"].default
        betas = [b.as_float(beta1, "actor.optim.adam_beta1") if beta1 not in (_ABSENT, None) else default[0],
                 b.as_float(beta2, "actor.optim.adam_beta2") if beta2 not in (_ABSENT, None) else default[1]]
        b.put("actor.betas", betas)
        for key, v in (("actor.optim.adam_beta1", beta1), ("actor.optim.adam_beta2", beta2)):
            if v not in (_ABSENT, None):
                b.carry(key, "actor.betas")
    b.simple("actor.optim.adam_eps", "actor.eps", b.as_float)
    b.simple("actor.optim.weight_decay", "actor.weight_decay", b.as_float)
    b.simple("actor.optim.clip_grad", "actor.grad_clip", b.as_float,
             lambda v: None if v > 0 else "Tidal always clips (actor.grad_clip > 0)")
    # LR schedule: Tidal warms up linearly, then decays by cosine to lr x min_lr_ratio.
    b.simple("actor.lr_sched.lr_warmup_iters", "actor.warmup_iters", b.as_int,
             lambda v: None if v >= 0 else "must be >= 0")
    style = b.take("actor.lr_sched.lr_decay_style")
    if style not in (_ABSENT, None):
        style = str(style).lower()
        if style == "constant":
            b.carry("actor.lr_sched.lr_decay_style", "actor.min_lr_ratio", 1.0)
        elif style == "cosine" and lr is not _ABSENT:
            floor_key = next((k for k in ("actor.lr_sched.min_lr", "actor.optim.min_lr")
                              if b.take(k) not in (_ABSENT, None)), None)
            peak = b.take("actor.lr_sched.max_lr")
            peak = lr if peak in (_ABSENT, None) else b.as_float(peak, "actor.lr_sched.max_lr")
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
    if peak not in (_ABSENT, None) and lr is not _ABSENT:
        if math.isclose(b.as_float(peak, "actor.lr_sched.max_lr"), lr):
            b.carry("actor.lr_sched.max_lr", "actor.lr")
        else:
            b.drop("actor.lr_sched.max_lr", "differs from actor.optim.lr; Tidal has one peak LR (actor.lr, "
                                            "from actor.optim.lr)")
    micro = b.simple("algorithm.training_batch_size_per_gpu", "actor.micro_batch_size", b.as_int, _positive)
    other = b.take("actor.micro_batch_size")
    if other not in (_ABSENT, None):
        if micro is _ABSENT:
            b.simple("actor.micro_batch_size", "actor.micro_batch_size", b.as_int, _positive)
        elif b.as_int(other, "actor.micro_batch_size") == micro:
            b.carry("actor.micro_batch_size", "actor.micro_batch_size")
        else:
            b.drop("actor.micro_batch_size", "differs from algorithm.training_batch_size_per_gpu (carried as "
                                             "actor.micro_batch_size)")


def _rollout(b: _Builder) -> None:
    sp = "algorithm.sampling_params"
    greedy_key = next((k for k, greedy in ((f"{sp}.use_greedy", True), (f"{sp}.do_sample", False))
                       if _is(b.take(k), greedy)), None)
    if greedy_key:
        b.carry(greedy_key, "rollout.temperature", 0.0)
        b.drop(f"{sp}.temperature", f"overridden: greedy decoding ({greedy_key.rsplit('.', 1)[1]}) is "
                                    "rollout.temperature: 0")
    else:
        b.simple(f"{sp}.temperature", "rollout.temperature", b.as_float,
                 lambda v: None if v >= 0 else "must be >= 0")
    b.simple(f"{sp}.top_p", "rollout.top_p", b.as_float, lambda v: None if 0 < v <= 1 else "must be in (0, 1]")
    top_k = b.take(f"{sp}.top_k")
    if top_k not in (_ABSENT, None):
        k = b.as_int(top_k, f"{sp}.top_k")
        if k < 0 or k >= _TOP_K_OFF:
            b.carry(f"{sp}.top_k", "rollout.top_k", 0)
            b.notes.append(f"rollout.top_k: 0 (top-k off) for RLinf's top_k: {k} (a 'very large' or negative k "
                           "disables top-k)")
        else:
            b.carry(f"{sp}.top_k", "rollout.top_k", k)
    b.simple(f"{sp}.max_new_tokens", "rollout.max_new_tokens", b.as_int, _positive)
    b.simple("rollout.tensor_parallel_size", "rollout.tensor_parallel_size", b.as_int, _positive)
    b.simple("rollout.max_running_requests", "rollout.max_running_requests", b.as_int, _positive)
    backend = b.take("rollout.rollout_backend")
    if backend not in (_ABSENT, None):
        if str(backend).lower() == "vllm":
            b.carry("rollout.rollout_backend", "rollout.backend", "vllm")
        else:
            b.drop("rollout.rollout_backend", f"value not supported: Tidal's rollout backends are native and vllm "
                                              f"({backend!r}); rollout.backend left at Tidal's default")


def _inference(b: _Builder) -> None:
    b.simple("inference.model.tensor_model_parallel_size", "inference.tensor_parallel_size", b.as_int, _positive)
    b.simple("algorithm.logprob_forward_micro_batch_size", "inference.micro_batch_size", b.as_int, _positive)


def _algorithm(b: _Builder) -> None:
    b.simple("algorithm.group_size", "algorithm.group_size", b.as_int, _positive)
    b.simple("algorithm.n_minibatches", "algorithm.n_minibatches", b.as_int, _positive)
    b.simple("algorithm.ratio_clip_eps", "algorithm.clip_eps", b.as_float, lambda v: None if v > 0 else "must be > 0")
    b.simple("algorithm.kl_beta", "algorithm.kl_coef", b.as_float, lambda v: None if v >= 0 else "must be >= 0")
    adv = b.take("algorithm.adv_type")
    if adv not in (_ABSENT, None):
        if str(adv).lower() in ("grpo", "grpo-math", "grpo_math"):
            b.carry("algorithm.adv_type", "algorithm.name", "grpo")
        else:
            b.drop("algorithm.adv_type", f"value not supported: Tidal runs GRPO only ({adv!r})")
            b.notes.append(f"algorithm: RLinf's adv_type {adv!r} has no Tidal equivalent; the converted run is GRPO")


def _data(b: _Builder) -> None:
    for src, target in (("data.train_data_paths", "data.train_files"), ("data.val_data_paths", "data.val_files")):
        v = b.take(src)
        if v in (_ABSENT, None):
            if v is None:
                b.drop(src, _NULL)
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
    b.simple("data.max_prompt_length", "data.max_prompt_length", b.as_int, _positive)
    b.simple("data.rollout_batch_size", "data.rollout_batch_size", b.as_int, _positive)
    b.simple("data.shuffle", "data.shuffle", b.as_bool)
    b.simple("data.apply_chat_template", "data.apply_chat_template", b.as_bool)
    b.simple("data.seed", "data.seed", b.as_int)
    key = "data.filter_prompt_by_length"
    v = b.take(key)
    if v not in (_ABSENT, None):
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


def _reward(b: _Builder) -> None:
    kind = b.take("reward.reward_type")
    if kind not in (_ABSENT, None):
        if str(kind).lower() == "math":
            b.carry("reward.reward_type", "reward.function", "math")
        else:
            b.drop("reward.reward_type", f"value not supported: Tidal's built-in rewards are gsm8k, math and exact "
                                         f"({kind!r}); set reward.function (e.g. module.path:function)")


def convert(doc: dict, *, source: str | None = None) -> Conversion:
    """Map an RLinf experiment mapping (interpolations resolved here) onto a plain Tidal config mapping."""
    field = source or "rlinf config"
    if not isinstance(doc, dict):
        raise ConfigError(field, type(doc).__name__, "top level must be a mapping of sections",
                          "pass an RLinf experiment YAML (cluster:, runner:, algorithm: ... sections)")
    doc = {str(k): v for k, v in doc.items()}
    resolved = _resolve_lenient(doc, field)
    b = _Builder(resolved, field)
    if "defaults" in doc:
        _defaults(b, doc["defaults"])
    for step in (_run, _cluster, _model, _actor, _rollout, _inference, _algorithm, _data, _reward):
        step(b)
    dropped, carried = b.result()
    return Conversion(config=_ordered(b.out), dropped=dropped, carried=carried, notes=tuple(b.notes),
                      source=source)


def convert_file(path: str | Path) -> Conversion:
    """Read an RLinf YAML with `yaml.safe_load` and convert it; `defaults:` files are reported, not followed."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("rlinf config", str(path), "file not found",
                          "pass the path of an RLinf experiment YAML, e.g. examples/reasoning/config/math/x.yaml")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError("rlinf config", str(path), f"is not valid YAML ({where})", "fix the syntax there") from None
    except UnicodeDecodeError:
        raise ConfigError("rlinf config", str(path), "is not UTF-8 text", "save the file as UTF-8") from None
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
