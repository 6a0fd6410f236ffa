"""Typed run configuration, loaded from YAML with `yaml.safe_load`.

A run is a config file plus a few `key.path=value` overrides. Every default is defined once, here.
The `cluster:` section takes RLinf's keys as they are (`num_nodes`, `component_placement`,
`auto_scheduler`, `use_pre_process_policy`, `use_wait_before_last_iter_policy`); the rest are Tidal's.

Devices: `cluster.device: auto` runs on CUDA when the machine has enough GPUs for the placement and on CPU
"virtual devices" (one worker process per device id) otherwise, so a GPU config runs on a laptop unchanged.

Every failure to load is a `ConfigError` naming the dotted field, the value and the fix.
"""

from __future__ import annotations

import difflib
import os
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tidal.core.bounded_yaml import MAX_VALUE_BYTES, load_yaml, read_text
from tidal.core.config_checks import check_cross_fields
from tidal.core.errors import ConfigError
from tidal.core.placement import Placement, parse_device_ids, parse_placement
from tidal.core.secrets import redacted


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are immutable once built, and no number is
    NaN or infinite (an infinite learning rate trains to NaN weights without a single error)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


MAX_CLUSTER_NODES = 1024         # bounds checked before anything is allocated or walked
MAX_DEVICES_PER_NODE = 1024
MAX_SEED = 2**63 - 1
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"   # a plain folder name: no separator, no `..`


class ClusterConfig(Section):
    num_nodes: int = Field(
        1, ge=1, le=MAX_CLUSTER_NODES,
        description="Nodes in the cluster (RLinf key); device ids run from 0 to num_nodes x num_devices_per_node - 1.")
    num_devices_per_node: int = Field(
        8, ge=1, le=MAX_DEVICES_PER_NODE,
        description="Devices per node: GPUs, or CPU virtual devices (one worker process each).")
    num_gpus_per_node: int | None = Field(
        None, ge=1, le=MAX_DEVICES_PER_NODE,
        description="RLinf's name for num_devices_per_node, accepted as RLinf configs spell it; set one of the two "
                    "(two different values are an error). null: not given.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="`auto`: CUDA when the machine has a GPU for every device of the cluster, else CPU virtual "
                    "devices; `cpu`; `cuda` (an error without enough GPUs).")
    cpu_compute_share: float | None = Field(
        None, gt=0, le=1,
        description="Fixed share of the machine's cores (of cpu_device_cores' cores when set) per CPU virtual device, "
                    "a cap enforced by a cgroup CPU quota or a duty cycle, e.g. 0.125 for 8 devices: idle capacity is "
                    "then lost, as on a GPU. CPU virtual devices of an embedded Ray only. null: no cap.")
    cpu_share_period_ms: float = Field(
        50.0, ge=5, le=1000,
        description="Period over which cpu_compute_share is enforced, in ms (CFS cpu.max period). A call needing a "
                    "little more CPU than one period's quota waits for the next period, so a short period quantizes "
                    "device speed less; below ~10 ms CFS overshoots the quota (docs/e2e.md).")
    cpu_device_cores: str | int | None = Field(
        None,
        description='Cores every thread of the CPU virtual devices is pinned to, e.g. `"1"` or `"2-7"`; '
                    "cpu_compute_share is then a fraction of these cores. Keeps devices on cores of one speed and the "
                    "driver off them, so a device's speed does not depend on its neighbours (docs/workers.md). Cores "
                    "the machine lacks are an error. null: any core.")
    component_placement: dict[str, Any] = Field(
        default_factory=lambda: {"actor": "0-1", "rollout": "2-5", "inference": "6-7"},
        description='RLinf placement (RLinf key): component -> device ids, e.g. `"0-3"`, `"0-1,4-5"`, `5` or `all`; '
                    'one key naming several components (`"actor,rollout": 0-7`) shares those devices: collocated '
                    "(all three on one set) or hybrid (two share, one apart), static placements whose shared devices "
                    "generate, "
                    "score and train in turn (`tidal validate` prints the plan). Components: actor, rollout, "
                    "inference, each placed once, on ids below the cluster's device count.")
    auto_scheduler: bool = Field(
        False,
        description="Dynamic scheduling (RLinf key): devices move between components at run time under "
                    "scheduler.policy (false: the static policy). Needs disjoint placements, contiguous in the order "
                    "actor -> rollout -> inference with the actor from device 0.")
    use_pre_process_policy: bool = Field(
        False,
        description="RLinf key, read by scheduler.policy `rlinf`: at step start the actor's devices also run rollout, "
                    "handed back once running <= scheduler.pre_process_threshold x total tasks (polled every 1 s). "
                    "Needs auto_scheduler.")
    use_wait_before_last_iter_policy: bool = Field(
        False,
        description="RLinf key, read by scheduler.policy `rlinf`: before the actor's last iter, wait until rollout "
                    "and inference have finished, then grow onto their devices. Needs auto_scheduler.")
    ray_address: str | None = Field(None, description="Ray cluster address to join; null starts an embedded local Ray.")
    failure_timeout_s: float = Field(
        60.0, gt=0, le=3600,
        description="A rollout or inference call with no result after this many seconds marks its device FAILED (a "
                    "hung worker; a dead process is found within 0.5 s); its work is redone on the survivors.")
    replace_failed: bool = Field(
        False, description="Start a replacement worker for a FAILED device; once it answers, the device rejoins the "
                           "free pool (scheduler and step-end placement use it again for rollout and inference). "
                           "The replacement is in no torch world: it never hosts the actor.")

    @model_validator(mode="after")
    def _rlinf_devices_per_node(self) -> ClusterConfig:
        if self.num_gpus_per_node is not None:
            if "num_devices_per_node" in self.model_fields_set and self.num_devices_per_node != self.num_gpus_per_node:
                raise ValueError(f"num_gpus_per_node={self.num_gpus_per_node} contradicts num_devices_per_node="
                                 f"{self.num_devices_per_node} (the same count; set one)")
            object.__setattr__(self, "num_devices_per_node", self.num_gpus_per_node)
        return self

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.num_devices_per_node

    @property
    def cpu_device_core_ids(self) -> tuple[int, ...] | None:
        if self.cpu_device_cores is None:
            return None
        return parse_device_ids(self.cpu_device_cores, "cluster.cpu_device_cores")


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="Hugging Face checkpoint directory (config.json, `*.safetensors`, tokenizer files): the "
                    "architecture, weights and tokenizer come from it, so the other model keys except max_seq_len "
                    "must stay unset (RLinf: rollout.model.model_path). null: Tidal's own model, built from those "
                    "keys and warm-started (warm_start).")
    vocab_size: int | None = Field(
        None, ge=2, le=1 << 22, description="Embedding rows of Tidal's own model; null: the task tokenizer's size.")
    hidden_size: int = Field(
        128, ge=8, le=1 << 16,
        description="Width of Tidal's own model; a multiple of num_heads with an even head dim (hidden_size / "
                    "num_heads).")
    num_layers: int = Field(4, ge=1, le=1024, description="Decoder layers of Tidal's own model.")
    num_heads: int = Field(
        4, ge=1, le=1024, description="Attention query heads of Tidal's own model; a multiple of num_kv_heads.")
    num_kv_heads: int = Field(
        2, ge=1, le=1024,
        description="Key/value heads of Tidal's own model (grouped-query attention); divides num_heads.")
    intermediate_size: int = Field(384, ge=8, le=1 << 20, description="SwiGLU hidden width of Tidal's own model.")
    max_seq_len: int = Field(
        64, ge=4, le=1 << 20,
        description="Longest prompt + response, in tokens; must exceed the response cap. With model.path and "
                    "data.train_files and this key unset: data.max_prompt_length + the response cap (RLinf: "
                    "runner.seq_length).")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base of Tidal's own model.")
    norm_eps: float = Field(1e-5, gt=0, description="RMSNorm epsilon of Tidal's own model.")
    tie_embeddings: bool = Field(
        False, description="Tidal's own model shares the input embedding with the output head.")

    @model_validator(mode="after")
    def _heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("head dim (hidden_size / num_heads) must be even for RoPE")
        return self


#: actor.backend values; RLinf's `actor.training_backend` takes these too (`fsdp` is refused with its fix)
ACTOR_BACKENDS = ("native", "megatron")


class ActorConfig(Section):
    backend: Literal["native", "megatron"] = Field(
        "native",
        description="Training engine of the actor, resharded online either way: `native` (Tidal's TP + ZeRO-1 "
                    "engine) or `megatron` (megatron-core's GPTModel, DDP and distributed optimizer; install with "
                    "`pip install -e '.[megatron]'`). `megatron` refuses actor.activation_checkpointing and "
                    "`actor.on_nonfinite: skip` (docs/megatron.md).")
    training_backend: str | None = Field(
        None,
        description="RLinf's name for actor.backend, accepted as RLinf configs spell it: `megatron` (or `native`); "
                    "RLinf's `fsdp` is refused (use actor.backend: native, Tidal's own engine). Set one of the two "
                    "(two different values are an error). null: not given.")
    megatron_transformer_engine: Literal["auto"] | bool = Field(
        "auto",
        description="With actor.backend: megatron, megatron-core's layer spec: `true` its Transformer Engine spec "
                    "(fused TE kernels; needs `transformer_engine` importable, else a config error), `false` its "
                    "local spec (torch modules), `auto` TE where `transformer_engine` imports, local elsewhere. The "
                    "choice is logged when the actor is built. Checkpoints are the same either way.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_DEVICES_PER_NODE,
        description="Actor TP size; divides num_heads, num_kv_heads and the actor's device count, the rest being data "
                    "parallel (RLinf: actor.model.tensor_model_parallel_size).")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (RLinf: actor.optim.lr).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1,
        description="Floor of the cosine LR decay as a fraction of lr, reached at the run's last iter (run.num_steps "
                    "x algorithm.n_minibatches).")
    warmup_iters: int = Field(
        2, ge=0, le=1 << 24,
        description="Linear LR warmup, in optimizer steps (iters) (RLinf: actor.lr_sched.lr_warmup_iters).")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW (beta1, beta2) (RLinf: actor.optim.adam_beta1, adam_beta2).")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon (RLinf: actor.optim.adam_eps).")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW decoupled weight decay (RLinf: actor.optim.weight_decay).")
    grad_clip: float = Field(
        1.0, gt=0, description="Clip of the global gradient L2 norm (RLinf: actor.optim.clip_grad).")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="An iter whose global gradient norm or loss is NaN or infinite is never applied: `stop` ends the "
                    "run with the iter, the rank and the last good checkpoint named; `skip` drops that update (the "
                    "weights, Adam moments and LR schedule stay as they were; the step's metric "
                    "`actor/nonfinite_skipped_frac` is the share of its iters skipped) and trains on.")
    micro_batch_size: int = Field(
        8, ge=1, le=1 << 16,
        description="Sequences per micro-batch; the actor's DP ranks pull micro-batches from the iter's shared queue "
                    "(RLinf key, or algorithm.training_batch_size_per_gpu).")
    max_tokens_per_micro_batch: int | None = Field(
        None, ge=1, le=1 << 24,
        description="Token budget of one actor micro-batch (RLinf's max_tokens_per_mbs): an iter's sequences, longest "
                    "first, fill micro-batches while rows x padded width stays within it, so similar lengths train "
                    "together and little is padded. At least model.max_seq_len. null: micro_batch_size sequences per "
                    "micro-batch in iter order. Either way a micro-batch is padded to its longest sequence's length "
                    "bucket (at most 25% more), never to model.max_seq_len.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Compute dtype of the actor and of the rollout and inference engines (RLinf: "
                    "actor.model.precision): float32, bfloat16; `auto`: fp32 on CPU, bf16 on GPU. The optimizer keeps "
                    "fp32 master weights either way; the engines load the actor's weights in this dtype.")
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward instead of keeping them: the actor's "
                    "peak memory for about a third more compute. The update is the same bit for bit on CPU.")
    offload_optimizer: bool = Field(
        False,
        description="On devices the actor shares with rollout (collocated, or an `actor,rollout` placement key): "
                    "while they generate, the fp32 master weights and Adam moments wait in pinned host memory and come "
                    "back before the actor trains (RLinf key). Disjoint placements: unused.")
    offload_grad: bool = Field(
        False,
        description="On devices the actor shares with rollout: the gradient buffer (and pooled buffers) are freed "
                    "while they generate; it holds nothing between iters (RLinf key). Disjoint placements: unused.")
    offload_weight: bool = Field(
        False,
        description="On devices the actor shares with rollout: the actor's parameters wait in pinned host memory "
                    "while they generate; the engines there got their copy at the weight sync (RLinf key). Disjoint "
                    "placements: unused.")
    redundancy: Literal["none", "host"] = Field(
        "none",
        description="A copy of the actor's whole state kept off its devices, so that a run recovering from the "
                    "loss of an actor device (run.max_restarts) redoes only the interrupted step: `host` writes the "
                    "run's state (parameters, fp32 masters, Adam moments, data position; the checkpoint format) "
                    "into host memory (actor.redundancy_dir) before the first step and after every step, keeping "
                    "the newest; a recovery resumes from the newer of it and the last checkpoint. Costs one write a "
                    "step (its `checkpoint` event's seconds) and the state's bytes of host memory.")
    redundancy_dir: str | None = Field(
        None,
        description="Where actor.redundancy: host keeps its copy (a folder per run, removed when the run ends); "
                    "null: /dev/shm (memory) where it is writable, else the system's temporary folder.")


    @field_validator("training_backend")
    @classmethod
    def _rlinf_backend_value(cls, v: str | None) -> str | None:
        if v is None or v in ACTOR_BACKENDS:
            return v
        if v == "fsdp":
            raise ValueError("RLinf's FSDP actor is not one of Tidal's engines: use actor.backend: native (Tidal's "
                             "TP + ZeRO-1 engine, the closest) or megatron")
        raise ValueError(f"is not an actor backend (one of {', '.join(ACTOR_BACKENDS)}): use actor.backend: native "
                         "or megatron")

    @model_validator(mode="after")
    def _rlinf_backend(self) -> ActorConfig:
        if self.training_backend is not None:
            if "backend" in self.model_fields_set and self.backend != self.training_backend:
                raise ConfigError("actor.training_backend", self.training_backend, f"contradicts actor.backend="
                                  f"{self.backend} (RLinf's name for the same choice)", "set only one of them")
            object.__setattr__(self, "backend", self.training_backend)
        return self


class RolloutConfig(Section):
    backend: Literal["native", "vllm"] = Field(
        "native",
        description="Generation engine: `native` (Tidal's torch engine) or `vllm` (RLinf: rollout.rollout_backend). "
                    "`tidal train` and `tidal validate` take `native` only (the pipeline's rollout is the native "
                    "engine); `tidal simulate` reads `vllm` as migration by re-prefill instead of KV-cache moves.")
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_DEVICES_PER_NODE,
        description="Devices per rollout instance (RLinf key); divides num_heads, num_kv_heads and the rollout device "
                    "count. `tidal train` runs 1 only.")
    max_running_requests: int = Field(
        64, ge=1, le=1 << 16,
        description="Concurrent sequences per rollout instance (RLinf key).")
    max_new_tokens: int = Field(
        16, ge=1, le=1 << 20,
        description="Response length cap in tokens, below model.max_seq_len (RLinf: "
                    "algorithm.sampling_params.max_new_tokens); data.max_response_length is verl's name for it (set "
                    "one).")
    temperature: float = Field(
        1.0, ge=0, description="Sampling temperature; 0 is greedy (RLinf: algorithm.sampling_params.temperature).")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling mass; 1 disables it (RLinf: algorithm.sampling_params.top_p).")
    top_k: int = Field(
        0, ge=0, le=1 << 22,
        description="Top-k sampling; 0 disables it (RLinf: algorithm.sampling_params.top_k).")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1,
        description="Fraction of a GPU's memory a native rollout engine may fill with its weights and KV cache (RLinf "
                    "key): the KV cache is paged, requests holding blocks as their tokens need them (the newest "
                    "preempted and re-prefilled when none is free). On a device shared with the "
                    "actor, count what the actor keeps resident there while it generates (see `actor.offload_*`). CPU "
                    "devices: unused.")
    partial: Literal["keep", "recompute"] = Field(
        "keep",
        description="An asynchronous run's requests in flight at a weight sync continue under the new weights (a "
                    "partial rollout): `keep` their KV cache, or `recompute` it (re-prefilled under the new "
                    "weights, as AReaL's interruptible generation). Read with algorithm.max_staleness >= 1.")
    slices_ahead: int = Field(
        2, ge=1, le=4,
        description="Generation time slices (0.1 s) kept queued per instance holding work: with 2 the next slice "
                    "starts on the worker as the current one returns, not after the driver's round trip; 1: one at a "
                    "time.")


class InferenceConfig(Section):
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_DEVICES_PER_NODE,
        description="Devices per inference (log-prob scoring) instance; divides num_heads, num_kv_heads and the "
                    "inference device count (RLinf: inference.model.tensor_model_parallel_size). `tidal train` runs 1 "
                    "only.")


class AlgorithmConfig(Section):
    name: Literal["grpo"] = Field("grpo", description="RL algorithm: `grpo`, the only one (RLinf: algorithm.adv_type).")
    group_size: int = Field(8, ge=1, le=1 << 12, description="Responses sampled per prompt (GRPO group; RLinf key).")
    n_minibatches: int = Field(
        2, ge=1, le=1 << 12,
        description="Actor optimizer steps (iters) per RL step (RLinf key); divides rollout_batch_size x group_size, "
                    "so every iter has the same global batch.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip range (RLinf: algorithm.ratio_clip_eps).")
    kl_coef: float = Field(
        0.0, ge=0,
        description="KL-to-reference coefficient of the GRPO loss (k3 estimator; RLinf: algorithm.kl_beta). `tidal "
                    "train` and `tidal validate` take 0 only: the pipeline keeps no reference model.")
    max_staleness: int = Field(
        0, ge=0, le=8,
        description="Asynchronous steps: rollout generates groups of up to this many steps ahead while the actor "
                    "trains, every token sampled under weights at most this many versions older than those the "
                    "step trains from (0: synchronous, on-policy). Static placements of rollout on its own devices "
                    "(AReaL: max_head_offpolicyness; verl: async_training.staleness_threshold).")
    rollout_is: Literal["token", "sequence"] | None = Field(
        None,
        description="Off-policy correction by truncated importance sampling (TIS): each token's policy-gradient term "
                    "times min(pi_old / pi_sampler, rollout_is_threshold), per token or with the sequence's product; "
                    "null: none (verl: algorithm.rollout_correction.rollout_is). Needs rollout.temperature 1.")
    rollout_is_threshold: float = Field(
        2.0, gt=0, le=1e6,
        description="The cap of rollout_is's weights (verl: algorithm.rollout_correction.rollout_is_threshold).")
    use_decoupled_loss: bool = Field(
        False,
        description="Decoupled PPO: each token's term times pi_old / pi_sampler, 0 where that exceeds "
                    "behav_imp_weight_cap (AReaL: actor.use_decoupled_loss). Not with rollout_is. Needs "
                    "rollout.temperature 1.")
    behav_imp_weight_cap: float | None = Field(
        None, gt=0, le=1e6,
        description="Decoupled PPO's cap: tokens whose weight exceeds it drop out of the loss; null keeps every "
                    "weight (AReaL: actor.behav_imp_weight_cap).")


class DataConfig(Section):
    task: str = Field(
        "addition",
        description="Built-in verifiable-reward task (addition, multiplication, sorting): the prompts when "
                    "train_files is empty; with model.path they go through the checkpoint's tokenizer. Not set "
                    "together with train_files.")
    train_files: list[str] = Field(
        default_factory=list,
        description="Prompt files (.jsonl, .parquet) of the RL stream, e.g. GSM8K's train split or a verl-layout "
                    "parquet; need model.path and val_files (RLinf: data.train_data_paths). Empty: the built-in "
                    "`task`.")
    val_files: list[str] = Field(
        default_factory=list,
        description="Held-out prompt files for the accuracy evaluation, needed with (and only with) train_files; the "
                    "first eval_size prompts are scored (RLinf: data.val_data_paths).")
    prompt_key: str = Field(
        "prompt", min_length=1,
        description="Column of the prompt: text, or a list of chat messages as in verl's `prompt`. Dotted paths reach "
                    "into nested columns (RLinf key).")
    answer_key: str = Field(
        "answer", min_length=1,
        description="Column of the ground truth, e.g. `answer` (GSM8K) or `reward_model.ground_truth` (verl); a "
                    "dotted path like prompt_key (RLinf key).")
    max_prompt_length: int = Field(
        512, ge=1, le=1 << 20,
        description="Longest prompt of the data files (train and val) in tokens, after the chat template; longer ones "
                    "are filtered (counted in the summary) or an error (data.truncation); so is a jsonl row too large "
                    "to hold such a prompt, unread (tidal/engine/datasets.py: max_row_bytes). RLinf key.")
    max_response_length: int | None = Field(
        None, ge=1, le=1 << 20,
        description="Response length cap in tokens (verl's name for rollout.max_new_tokens; set one).")
    truncation: Literal["filter", "error"] = Field(
        "filter",
        description="Prompts over max_prompt_length: `filter` drops and counts them, `error` stops the run (RLinf: "
                    "data.filter_prompt_by_length: true is filter).")
    unpayable_answers: Literal["error", "warn"] = Field(
        "error",
        description="Kept prompts whose ground truth the builtin verifier can never pay (gsm8k: no number; math, "
                    "exact: empty), checked before the run: `error` names the first one's file and row, `warn` logs "
                    "them and trains on them (counted as `unpayable` in the prompt summary). A custom "
                    "reward.function is not checked.")
    shuffle: bool = Field(
        True,
        description="Shuffle the prompt files' rows each epoch (seeded by data.seed); false: file order (RLinf key).")
    apply_chat_template: bool | None = Field(
        None,
        description="Render each prompt as a user message with the generation prompt through model.path's chat "
                    "template (RLinf key). null: on when the tokenizer has a template.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra chat-template arguments, e.g. {enable_thinking: false} for Qwen3 (RLinf: "
                    "data.apply_chat_template_kwargs).")
    rollout_batch_size: int = Field(16, ge=1, le=1 << 20, description="Prompts (GRPO groups) per RL step (RLinf key).")
    eval_size: int = Field(
        256, ge=1, le=1 << 20, description="Held-out prompts per evaluation (also the warm start's held-out set).")
    seed: int = Field(
        0, ge=0, le=MAX_SEED,
        description="Seed of the built-in task's train/held-out split, of the files' shuffle and of the warm start's "
                    "examples (RLinf key).")


class RewardConfig(Section):
    function: str | None = Field(
        None,
        description="Verifier: gsm8k (#### N, else the last number), gsm8k_strict, math (last \\boxed{} by symbolic "
                    "equivalence, math-verify), exact, or `module.path:function` with verl's signature "
                    "compute_score(data_source, solution_str, ground_truth, extra_info=None) (RLinf: "
                    "reward.reward_type: math is math). null: gsm8k with data files, exact with a built-in task "
                    "(for Tidal's own model, the task's exact verifier on its character tokens).")
    timeout_s: float = Field(
        10.0, gt=0, le=3600,
        description="Longest one call of `math` or a custom function may take (they run in a child process); one that "
                    "takes longer scores 0 and is counted (reward/timeouts). exact, gsm8k and gsm8k_strict run "
                    "inline, without a limit.")


class WarmStartConfig(Section):
    num_examples: int = Field(
        2000, ge=1, le=1 << 24,
        description="Labelled examples of the supervised warm start (small on purpose). The warm start trains Tidal's "
                    "own model (model.path unset) on data.task before RL and is cached by its settings under "
                    "run.output_dir/.warmstart/; `tidal warm-start` reads the same keys.")
    iters: int = Field(
        2400, ge=0, le=1 << 24,
        description="Warm-start optimizer steps; 0 skips it (RL from the random init).")
    lr: float = Field(1e-3, gt=0, description="Warm-start AdamW learning rate.")
    batch_size: int = Field(64, ge=1, le=1 << 16, description="Warm-start sequences per step.")
    label_noise: float = Field(
        0.3, ge=0, lt=1, description="Fraction of labelled examples with one wrong answer digit.")
    eval_every: int | None = Field(
        None, ge=1, le=1 << 24, description="Warm-start steps between held-out evaluations. null: iters / 8.")
    stop_at_accuracy: float | None = Field(
        None, gt=0, le=1,
        description="End the warm start at the first evaluation whose held-out accuracy reaches this: a model that "
                    "solves the task this well on any machine. null: run all iters.")
    checkpoint: str | None = Field(
        None,
        description="Start Tidal's own model from this safetensors file (its tensors must fit the model keys) instead "
                    "of warm-starting it. null: warm start.")


class SchedulerConfig(Section):
    policy: Literal["tidal", "rlinf", "static"] = Field(
        "tidal",
        description="Device reallocation policy when cluster.auto_scheduler is on: `tidal` (moves only when its cost "
                    "model predicts they pay), `rlinf` (RLinf's scheduler, flaws included), `static` (never moves a "
                    "device). auto_scheduler off: static.")
    pre_process_threshold: float = Field(
        0.5, gt=0, le=1,
        description="rlinf policy with cluster.use_pre_process_policy: the actor's devices come back once running <= "
                    "threshold x total tasks (RLinf: cluster.preprocess_threshold).")
    margin_s: float = Field(
        0.0, ge=0,
        description="tidal: a move must beat doing nothing by this many predicted seconds on top of its own modelled "
                    "cost (churn guard).")
    margin_frac: float = Field(
        0.01, ge=0, lt=1,
        description="tidal: ... plus this fraction of the predicted seconds the move improves on (the model's error "
                    "grows with what it predicts).")
    grow_on_return: bool = Field(
        True,
        description="tidal: when devices lent at step start return, it may also release rollout instances and grow "
                    "the actor at once (false: the next iter boundary decides).")
    lend_actor: bool = Field(
        True,
        description="tidal: while the actor waits for its next mini-batch, its devices may host rollout instances "
                    "when the cost model says it pays (false: they stay with the actor).")
    return_on_generated: bool = Field(
        True,
        description="tidal: devices lent while the actor waits come back once its mini-batch is generated, so the "
                    "moves run while its last groups are scored (false: once it is scored).")


class RunConfig(Section):
    name: str = Field(
        "run", pattern=RUN_NAME_PATTERN, max_length=100,
        description="Run name: the MLflow run's name and the output folder `<output_dir>/<name>-<time>` (RLinf: "
                    "runner.experiment_name): letters, digits, `.`, `_`, `-`, starting with a letter or digit, so the "
                    "folder stays inside run.output_dir.")
    num_steps: int = Field(10, ge=1, le=1 << 24, description="RL steps (RLinf: runner.max_steps).")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the model init and of sampling (RLinf: actor.seed).")
    output_dir: str = Field(
        "runs",
        description="Parent of the run's output folder and of the warm-start cache .warmstart/ (RLinf: "
                    "runner.output_dir).")
    eval_every: int = Field(
        1, ge=1, le=1 << 24,
        description="Evaluate held-out accuracy every N steps and after the last one, besides once before the first "
                    "(RLinf: runner.val_check_interval).")
    checkpoint_every: int = Field(
        0, ge=0, le=1 << 24,
        description="Checkpoint (`<run folder>/checkpoints/gen-N`) every N steps; the end of the run always gets one; "
                    "0: only at the end (RLinf: runner.save_interval).")
    max_restarts: int = Field(
        2, ge=0, le=1000,
        description="Times a run recovers in process from a device lost beyond what a step absorbs (an actor "
                    "device, a loss outside a step's streaming loop, a component's last device, a hung call): from "
                    "its newest checkpoint or actor.redundancy's copy, the steps since run again, on the surviving "
                    "workers where they can carry on, else on new ones. 0: the run ends on record and `--resume` "
                    "continues it.")
    save_hf: bool = Field(
        False,
        description="With each checkpoint also write the model as a Hugging Face directory `<run folder>/hf/step-N` "
                    "(config.json, safetensors, tokenizer, generation_config.json; the newest two are kept). Needs "
                    "model.path.")
    save_hf_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of save_hf's weights: float32, bfloat16, float16; `auto`: that of model.path's checkpoint "
                    "on disk.")


class TrackingConfig(Section):
    db_url: str = Field(
        "sqlite:///tidal.db",
        description="Platform database URL: SQLite by default, PostgreSQL by URL. $TIDAL_DB_URL, when set, replaces "
                    "it before the key=value overrides.")
    mlflow_uri: str = Field(
        "sqlite:///mlruns.db",
        description="MLflow tracking URI; sqlite:/// needs no server. $MLFLOW_TRACKING_URI, when set, replaces it "
                    "before the key=value overrides.")
    mlflow_artifacts: str = Field(
        "mlartifacts",
        description="Artifact location (a directory, made absolute) given to the MLflow experiment when it is "
                    "created; an existing experiment keeps its own.")
    experiment: str = Field("tidal", description="MLflow experiment name (RLinf: runner.logger.project_name).")


class TidalConfig(Section):
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    model: ModelConfig = ModelConfig()
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    inference: InferenceConfig = InferenceConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    data: DataConfig = DataConfig()
    warm_start: WarmStartConfig = WarmStartConfig()
    reward: RewardConfig = RewardConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    tracking: TrackingConfig = TrackingConfig()

    @cached_property
    def placement(self) -> Placement:
        return parse_placement(self.cluster.component_placement, self.cluster.num_devices,
                               self.cluster.auto_scheduler)

    @property
    def response_length(self) -> int:
        """Response cap in tokens: data.max_response_length if set, else rollout.max_new_tokens."""
        return self.data.max_response_length or self.rollout.max_new_tokens

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + response: model.max_seq_len, or with a checkpoint and data files and no explicit
        model.max_seq_len, data.max_prompt_length + response_length."""
        if self.model.path and self.data.train_files and "max_seq_len" not in self.model.model_fields_set:
            return self.data.max_prompt_length + self.response_length
        return self.model.max_seq_len

    @property
    def uses_files(self) -> bool:
        return bool(self.data.train_files)

    @property
    def sequences_per_iter(self) -> int:
        """Global batch of one actor iter, in sequences (fixed whatever the DP size)."""
        return self.data.rollout_batch_size * self.algorithm.group_size // self.algorithm.n_minibatches


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = TidalConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        ann = model.model_fields[part].annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return model


def _translate(err: ValidationError) -> ConfigError:
    e = err.errors()[0]
    loc = tuple(e.get("loc", ()))
    field = ".".join(str(x) for x in loc) or "<config>"
    value = e.get("input")
    if e["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        known = list(parent.model_fields) if parent else []
        near = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = f"did you mean {'.'.join(map(str, loc[:-1] + (near[0],)))!r}?" if near else \
            f"remove it; known keys here: {', '.join(known)}"
        return ConfigError(field, loc[-1], "unknown key", fix)
    if e["type"] == "model_type" or e["type"] == "dict_type":
        return ConfigError(field, value, "must be a mapping of keys", "write it as `key: value` lines")
    fix = "see docs/config.md for the allowed values"
    parent = _model_at(loc[:-1]) if loc else None
    if parent and loc and str(loc[-1]) in parent.model_fields:
        doc = parent.model_fields[str(loc[-1])].description
        if doc:
            fix = f"{loc[-1]}: {doc}"
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return ConfigError(field, value, msg, fix)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`["actor.lr=3e-4", "cluster.component_placement.actor=0-3"]` applied onto a plain dict."""
    data = dict(data)
    defaults = TidalConfig().model_dump() if overrides else {}
    for ov in overrides:
        key, sep, raw = ov.partition("=")
        if not sep or not key.strip():
            raise ConfigError("override", ov, "is not key.path=value", "e.g. actor.lr=3e-4")
        try:
            value = load_yaml(raw, key.strip(), MAX_VALUE_BYTES) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        default: Any = defaults  # walks the defaults alongside; below a leaf it is None
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            default = default.get(part) if isinstance(default, dict) else None
            # a missing section starts empty (its fields keep their defaults and count as unset); a missing
            # mapping value such as component_placement starts from its default mapping
            is_section = _model_at(tuple(parts[:i + 1])) is not None
            child = node.get(part, None if is_section else default)
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def build_config(data: object, overrides: list[str] | None = None) -> TidalConfig:
    """Validate a plain mapping (plus overrides) into a TidalConfig, or raise ConfigError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<config>", type(data).__name__, "top level must be a mapping of sections",
                          "start the file with `cluster:`, `actor:` ... sections")
    for k in data:
        if not isinstance(k, str):
            raise ConfigError("<config>", k, "section names must be strings", "use names like `cluster`")
    data = apply_overrides(data, overrides or [])
    try:
        cfg = TidalConfig.model_validate(data)
    except ValidationError as err:
        raise _translate(err) from None
    except (TypeError, ValueError) as err:  # pydantic raises these for unhashable/odd inputs in rare paths
        raise ConfigError("<config>", str(err)[:80], "could not be read as a config", "check the YAML types") from None
    _ = cfg.placement
    _ = cfg.cluster.cpu_device_core_ids  # ConfigError naming the field on a bad core list
    check_cross_fields(cfg)
    return cfg


def read_yaml(path: str | Path, field: str = "config",
              example: str = "pass a path like experiments/addition_dynamic.yaml") -> object:
    """The document of a YAML file (`bounded_yaml.load_yaml`: SafeLoader, size, values and depth bounded); a
    missing, unparsable, oversized or non-UTF-8 file is a ConfigError naming `field` and, for syntax, the line and
    column."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(field, str(path), "file not found", example)
    try:
        return load_yaml(read_text(p, field), field)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise ConfigError(field, str(path), f"is not valid YAML ({where})", "fix the syntax there") from None
    except UnicodeDecodeError:
        raise ConfigError(field, str(path), "is not UTF-8 text", "save the file as UTF-8") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> TidalConfig:
    """Read YAML (`yaml.safe_load`) at `path` and build the config."""
    return build_config(read_yaml(path), overrides)


def public_dump(cfg: TidalConfig) -> dict:
    """The config as JSON values with every credential masked: what may be stored, tracked or printed."""
    out = redacted(cfg.model_dump(mode="json"))
    assert isinstance(out, dict)
    return out


def flatten(cfg: TidalConfig) -> dict[str, object]:
    """Dotted-key view of a config (MLflow params, sweep spaces), credentials masked (`tidal.core.secrets`)."""
    out: dict[str, object] = {}

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", public_dump(cfg))
    return out


def sweep_storage(db_url: str, storage: str | None = None) -> str:
    """Where Optuna studies live, for `tidal sweep` and the dashboard `tidal up` starts alike: the explicit URL,
    else $TIDAL_OPTUNA_STORAGE, else the platform database (`tracking.db_url`)."""
    return storage or os.environ.get("TIDAL_OPTUNA_STORAGE") or db_url
