"""The "megatron" actor backend: megatron-core's GPTModel + DDP + DistributedOptimizer behind `ActorBackend`.

One `MegatronBackend` per world rank, constructed like `ActorShard` (args, OptimConfig, layout, rank, seed,
device, dtype, weights=...) on every world rank; the layout may be any subset of the world's ranks (e.g. devices
2-5 of 6), ranks outside it hold nothing and return None from `train_iter` / `export_weights`. What a rank of
layout (tp, dp) builds::

    process groups      a `ProcessGroupCollection` of the layout's TP / DP / all-ranks groups
                        (tidal/engine/backends/megatron_groups.py), passed to GPTModel, DDP and the optimizer;
                        megatron-core's global parallel_state is never initialized for training
    GPTModel            megatron-core's local layer spec, or its Transformer Engine spec (`transformer_engine`:
                        auto | True | False, `layer_spec` says which and why; q/k_layernorm with qk_norm),
                        TransformerConfig from our ModelArgs (`megatron_map.transformer_config`: head_dim,
                        qkv_bias, qk_norm, RoPE scaling), calculate_per_token_loss=True (see grads below); built
                        without megatron's init (perform_initialization=False), so the TP attributes its init would
                        set on the split weights are set by `_set_tp_attributes` (the optimizer's grad norm reads
                        them)
    weights             our global weights (HF names) -> `to_megatron` (fused QKV, [gate; up], padded vocab) ->
                        `megatron_tp_shard`; the fp32 main params are then set from the fp32 weights (not from the
                        bf16-rounded params), as ActorShard initializes its masters
    DDP                 DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                        overlap_grad_reduce=False): grads accumulate in an fp32 flat buffer over micro-batches and
                        are reduce-scattered once per iter; with calculate_per_token_loss and
                        average_in_collective=False the DP reduction is a plain sum (no 1/dp scaling), which is our
                        loss convention: each micro-batch's loss is summed over its tokens / num_tokens_in_iter;
                        at TP > 1 the q/k_layernorm grads are then summed over TP (each rank saw its heads only)
    optimizer           get_megatron_optimizer(OptimizerConfig(optimizer="adam", ...)): DistributedOptimizer over
                        torch AdamW (decoupled weight decay), fp32 main params, grad clip by global L2 norm
    LR / weight decay   set on every param group before each step from our OptimConfig: `lr_at(hp, step)`
                        (warmup + cosine, as ActorShard) and hp.weight_decay on *all* parameters (megatron-core
                        would exempt norms; ActorShard does not)

`train_iter(source, loss_fn, num_tokens_in_iter)` claims micro-batches from the same `MicrobatchSource` as
ActorShard (TP ranks of a DP group agree on the index), calls `loss_fn(self.model, mb, num_tokens_in_iter)` and
backpropagates it; `self.model` is a `GPTAdapter` with our model's `token_logprobs(ids_BT)` (fp32 log-probs of the
real vocab: the padded columns are masked out of the softmax), so loss functions written for our Transformer
(`nll_loss`, GRPO's) run unchanged. Then one DDP grad sync and one optimizer step; returns an `IterReport`.

`reshard(new_layout)`: plan / execute / commit of the full state (params, fp32 main params, exp_avg, exp_avg_sq,
step) through tidal/engine/backends/megatron_state_reshard.py, to any layout over any device set (collective over
the world). The new stack (its groups, GPTModel, DDP, optimizer) is built first on the new layout's ranks, the
ranges of both layouts are all-gathered over the world, the moves run, two world votes commit; on a failure the
old stack stays as it was (no global state to restore) and ReshardError is raised.

`save_megatron` / `load_megatron`: weights and distributed-optimizer state (fp32 main params, Adam moments, step)
through megatron-core's dist_checkpointing (megatron_state_ckpt.py), readable at any (tp, dp); a weights-only
checkpoint loads with the moments reset (or kept) and `CheckpointLoad.optimizer` says which. dist_checkpointing
reads the global parallel_state: they need the layout to be the whole world in rank order
(`megatron_groups.parallel_state_for`).

In the pipeline (tidal/workers/roles.py, through the protocol's verbs):

    export_weights / gather_replica   the engines' names, TP split and compute dtype: the layout's TP shards are
                                      all-gathered (Megatron splits every tensor evenly, so the pieces are equal)
                                      to GPTModel's global weights, `from_megatron` unfuses QKV and [gate; up] and
                                      drops the padded vocab rows, then our TP shard t is cut (TP 1: no gather)
    save_checkpoint / load_checkpoint the native run-checkpoint format (tidal/engine/checkpoint.py), so a run
                                      resumes on either backend: the full state (params, fp32 main params, Adam
                                      moments, step, data cursor) is gathered over the layout in global terms,
                                      converted to our names and written through an `ActorShard` of the same
                                      layout; a load reads it into an `ActorShard` at the target layout (the native
                                      loader's resharding) and sets this backend's state from its global view.
                                      Costs one full fp32 copy of the state per layout rank while it runs. When the
                                      layout spans the world, the generation also holds `megatron/`: the same
                                      state through `save_megatron`; a load at a world-wide layout reads that copy
                                      (`CheckpointLoad.source` "megatron"), any other load the native shards
    program_inputs                    None: the moves are planned on the ranks (`megatron_state_reshard`)
    offload / onload                  `optimizer`: the fp32 main-param shards that are tensors of their own (bf16
                                      params; fp32 params' shards are views of the param buffer and go with it)
                                      and the Adam moments to host memory (pinned on CUDA), each tensor object
                                      kept (its `.data` swapped), so the optimizer, our range index and the
                                      reshard views stay bound; `grad`: DDP's grad buffers freed (storage resized
                                      to 0, megatron-core's `offload_grad_buffers`; every `main_grad` view stays a
                                      view and is zeroed on restore, as before every iter); `weight`: DDP's param
                                      buffers copied out and freed the same way. `onload` restores each bit for bit
    held_bytes / resident_bytes       DDP's param and grad buffers, fp32 main params and moments on this rank

CPU: megatron-core's DDP and optimizer run on gloo inside `megatron_cpu.optimizer_shim()` (its table lists the
sites). GPU: every shim is a no-op; megatron's CUDA RNG tracker is seeded per TP rank
(`model_parallel_cuda_manual_seed(seed, tp_rank=t)`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from tidal.core.errors import ConfigError, LayoutError, TrainingError
from tidal.engine.actor import ActorShard, ExportedWeights, IterReport
from tidal.engine.backends import megatron_cpu as mc
from tidal.engine.backends.megatron_groups import (
    MegatronGroups,
    init_process_state,
    layout_gather,
    require_whole_world,
    spans_world,
)
from tidal.engine.backends.megatron_map import (
    FC1,
    choose_layer_spec,
    from_megatron,
    gpt_layer_spec,
    gpt_model_kwargs,
    local_param_name,
    megatron_tp_shard,
    padded_vocab_size,
    te_importable,
    to_megatron,
    transformer_config,
)
from tidal.engine.backends.megatron_reshard import check_layout, megatron_specs
from tidal.engine.backends.megatron_state_ckpt import StateLoad, load_state, save_state
from tidal.engine.backends.megatron_state_reshard import (
    OptView,
    StateViews,
    execute_state,
    gather_ranges,
    plan_state,
    split_unit_range,
)
from tidal.engine.backends.native import save_shard
from tidal.engine.backends.protocol import CheckpointLoad, register_backend
from tidal.engine.checkpoint import CheckpointError, CheckpointMeta, ShardRecord, load_actor, read_manifest
from tidal.engine.groups import GroupCache, reshard_rank_sets
from tidal.engine.layout import Layout, ParamSpec, synced_layout
from tidal.engine.model import ModelArgs, init_global_weights, param_specs
from tidal.engine.optim import OPT_KINDS, OptimConfig, ShardState, lr_at
from tidal.engine.reshard import ReshardError, ReshardPlan, ReshardReport
from tidal.engine.tp import vocab_parallel_logprobs

log = logging.getLogger("tidal.megatron")

#: the run-checkpoint generation's subfolder holding the megatron-format copy of the state
MEGATRON_DIR = "megatron"


class GPTAdapter(nn.Module):
    """GPTModel (through its DDP wrapper) with our model's `token_logprobs` (see module doc)."""

    def __init__(self, ddp, vocab_size: int, padded_vocab: int, tp: int, t: int, tp_group, device):
        super().__init__()
        self.ddp, self.vocab_size, self.tp_group = ddp, vocab_size, tp_group
        self.vocab_lo = padded_vocab // tp * t
        cols = torch.arange(self.vocab_lo, self.vocab_lo + padded_vocab // tp, device=device)
        self.register_buffer("pad_cols", cols >= vocab_size, persistent=False)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """TP-local logits [B, T, Vp/tp] with the padded vocab columns at -1e30 (out of the softmax)."""
        b, t = ids_BT.shape
        pos = torch.arange(t, device=ids_BT.device).expand(b, t)
        with mc.cpu_shim():
            logits = self.ddp(ids_BT, pos, mc.causal_mask(t, ids_BT.device))
        # finite, not -inf: a TP rank whose slice is all padding must still give 0 (not nan) when its picked logit
        # is multiplied by 0 in vocab_parallel_logprobs; exp(-1e30 - max) is exactly 0 in fp32
        return logits.masked_fill(self.pad_cols, -1e30)

    def token_logprobs(self, ids_BT: torch.Tensor, attn_mask_BTS=None, positions_BT=None) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1: [B, T-1], fp32 (causal attention, positions 0..T-1)."""
        return self.token_logprobs_entropy(ids_BT, attn_mask_BTS, positions_BT, with_entropy=False)[0]

    def token_logprobs_entropy(self, ids_BT: torch.Tensor, attn_mask_BTS=None, positions_BT=None,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probs as `token_logprobs`, the entropy of p(. | ids[:, :t+1]) without grad, or None), as our
        model's (the GRPO loss calls this); the [B, T-1, Vp/tp] logits are whole (our model chunks them)."""
        if attn_mask_BTS is not None or positions_BT is not None:
            raise NotImplementedError("the megatron backend runs causal attention over positions 0..T-1 only "
                                      "(pass input ids without attn_mask_BTS / positions_BT)")
        logits = self.forward(ids_BT)[:, :-1]
        if not with_entropy:
            return vocab_parallel_logprobs(logits, ids_BT[:, 1:], self.tp_group, self.vocab_lo), None
        return vocab_parallel_logprobs(logits, ids_BT[:, 1:], self.tp_group, self.vocab_lo, with_entropy=True)


class _Stack:
    """parallel_state + GPTModel + DDP + DistributedOptimizer of one layout on one rank."""

    def __init__(self, args: ModelArgs, hp: OptimConfig, layout: Layout, rank: int, padded_vocab: int,
                 dtype: torch.dtype, device: torch.device, seed: int, weights: dict[str, torch.Tensor] | None,
                 pgc: Any, transformer_engine: bool = False):
        mc.import_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.tensor_parallel import random as mrandom

        init_process_state()
        self.layout, self.t, self.d = layout, *cast("tuple[int, int]", layout.coord(rank))  # a rank of the layout
        if device.type == "cuda":
            mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=self.t, ep_rank=0, etp_rank=0)
        tp = layout.tp
        cfg = transformer_config(args, tp, dtype, calculate_per_token_loss=True, perform_initialization=False)
        with mc.cpu_shim():
            from megatron.core.models.gpt.gpt_model import GPTModel

            model = GPTModel(cfg, gpt_layer_spec(args, transformer_engine), **gpt_model_kwargs(args, padded_vocab),
                             pg_collection=pgc)
        model.to(device)
        # GPTModel's params in the local spec's names (the TE spec fuses the pre-norms into the next linear)
        self.params = {local_param_name(n, transformer_engine): p for n, p in model.named_parameters()}
        _set_tp_attributes(self.params, args, padded_vocab)
        local = None
        if weights is not None:
            local = megatron_tp_shard(to_megatron(weights, args, padded_vocab), args, tp, self.t)
            if transformer_engine:
                with torch.no_grad():
                    for name, p in self.params.items():
                        p.copy_(local[name])
            else:
                mc.load_gpt_weights(model, local)
        ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                overlap_grad_reduce=False, overlap_param_gather=False,
                                                average_in_collective=False)
        opt_cfg = OptimizerConfig(optimizer="adam", lr=hp.lr, weight_decay=hp.weight_decay, adam_beta1=hp.betas[0],
                                  adam_beta2=hp.betas[1], adam_eps=hp.eps, clip_grad=hp.grad_clip,
                                  bf16=dtype == torch.bfloat16, fp16=False, params_dtype=dtype,
                                  use_distributed_optimizer=True)
        with mc.optimizer_shim(), layout_gather(pgc.intra_dist_opt, dist.get_world_size()):
            self.ddp = DistributedDataParallel(cfg, ddp_cfg, model, pg_collection=pgc)
            self.opt = get_megatron_optimizer(opt_cfg, [self.ddp], use_gloo_process_groups=False, pg_collection=pgc)
        self.model, self.cfg = model, cfg
        self.dopts = list(getattr(self.opt, "chained_optimizers", [self.opt]))
        tp_group = pgc.tp if tp > 1 else None
        self.dp_group = pgc.dp if layout.dp > 1 else None
        self.tp_group = tp_group
        self.adapter = GPTAdapter(self.ddp, args.vocab_size, padded_vocab, tp, self.t, tp_group, device)
        self._index_optimizer()
        if local is not None:  # fp32 main params from the fp32 weights (ActorShard's masters), not the cast params
            with torch.no_grad():
                for name, (lo, hi, main) in self.main.items():
                    main.copy_(local[name].reshape(-1)[lo:hi].to(main))

    def _index_optimizer(self) -> None:
        """name -> (lo, hi, fp32 main param shard) for every param this rank owns a range of."""
        main_of: dict[int, torch.Tensor] = {}
        self.inner_of: dict[int, Any] = {}
        for dopt in self.dopts:
            pairs = list(zip(dopt.model_float16_groups, dopt.shard_fp32_from_float16_groups)) + \
                list(zip(dopt.model_fp32_groups, dopt.shard_fp32_groups))
            for models, shards in pairs:
                for p, s in zip(models, shards):
                    main_of[id(p)] = s
                    self.inner_of[id(p)] = dopt
        self.main: dict[str, tuple[int, int, torch.Tensor]] = {}
        for name, p in self.params.items():
            if id(p) not in main_of:
                continue
            r = self.inner_of[id(p)]._get_model_param_range_map(p)["param"]
            self.main[name] = (r.start, r.end, main_of[id(p)])

    def moments(self, name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(exp_avg, exp_avg_sq) of param `name`'s main shard; created as torch AdamW would (zeros, step) if the
        optimizer has not stepped yet."""
        main = self.main[name][2]
        state = self.inner_of[id(self.params[name])].optimizer.state[main]
        if not state:
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(main)
            state["exp_avg_sq"] = torch.zeros_like(main)
        return state["exp_avg"], state["exp_avg_sq"]

    def set_step(self, step: int) -> None:
        for name in self.main:
            self.moments(name, step)
            self.inner_of[id(self.params[name])].optimizer.state[self.main[name][2]]["step"].fill_(float(step))

    @torch.no_grad()
    def views(self, specs: tuple[ParamSpec, ...], step: int) -> StateViews:
        params: list[torch.Tensor] = []
        opt: list[OptView | None] = []
        for spec in specs:
            name, _, half = spec.name.partition("#")
            p = self.params[name].data
            n = p.shape[0] // 2
            params.append(p if not half else (p[:n] if half == "gate" else p[n:]))
            if name not in self.main:
                opt.append(None)
                continue
            lo, hi, main = self.main[name]
            m, v = self.moments(name, step)
            a, b = split_unit_range(lo, hi, p.numel(), half)
            if b <= a:
                opt.append(None)
                continue
            base = 0 if half != "up" else p.numel() // 2
            cut = slice(a + base - lo, b + base - lo)
            opt.append((a, b, main[cut], m[cut], v[cut]))
        return StateViews(specs, self.layout.tp, self.t, params, opt)


class MegatronBackend:
    """See the module doc. Construct on every world rank (collective)."""

    name = "megatron"

    def __init__(self, args: ModelArgs, hp: OptimConfig, layout: Layout, rank: int, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None, *,
                 weights: dict[str, torch.Tensor] | Literal["empty"] | None = None, padded_vocab: int | None = None,
                 groups: GroupCache | None = None, activation_checkpointing: bool = False,
                 transformer_engine: bool | Literal["auto"] = "auto"):
        """`weights`: our global weights; None: `init_global_weights(args, seed)`; "empty": GPTModel's params as
        built (a state set later, e.g. by a checkpoint load). `activation_checkpointing` is not wired to
        megatron-core's recompute here, so True is refused (the config refuses it first).
        `transformer_engine` (`actor.megatron_transformer_engine`): megatron-core's TE layer spec (True), its local
        spec (False), or TE where `transformer_engine` imports ("auto"); True without it is a ConfigError. What
        was chosen is `layer_spec` (logged once by rank 0)."""
        if activation_checkpointing:
            raise ConfigError("actor.activation_checkpointing", True, "is not supported by the megatron actor "
                              "backend", "set actor.activation_checkpointing: false or actor.backend: native")
        self.args, self.hp, self.rank, self.seed = args, hp, rank, seed
        self.layer_spec = choose_layer_spec(transformer_engine, te_importable())
        self.build = f"megatron, {self.layer_spec} layer spec"
        if rank == 0:
            log.info("megatron actor: layer spec %s", self.layer_spec)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        # one padded size for every layout (it is part of the global shape the planner moves): Megatron-LM's
        # rule at TP 1 (a multiple of 128, divisible by every TP size up to 128)
        self.padded_vocab = padded_vocab or padded_vocab_size(args.vocab_size, 1)
        self.specs = megatron_specs(args, self.padded_vocab)
        check_layout(self.args, self.padded_vocab, layout)
        self.groups = groups or GroupCache()   # the layouts' TP / DP / all-ranks groups, as ActorShard's
        self._pgs = MegatronGroups(self.groups)
        self.step, self.data_cursor = 0, 0
        self._phases: dict[str, float] = {}   # the last forward_backward's compute and sync seconds
        # what `offload` moved ("optimizer", "grad", "weight") until `onload`: each buffer's storage size and the
        # host copy of its params
        self.offloaded: set[str] = set()
        self._sizes: dict[tuple[int, str], int] = {}
        self._host: dict[int, torch.Tensor] = {}
        if layout.coord(rank) is not None and weights is None:
            weights = init_global_weights(args, seed)
        self.stack = self._build(layout, None if weights == "empty" else weights)
        self.layout = layout

    def _build(self, layout: Layout, weights: dict[str, torch.Tensor] | Literal["empty"] | None) -> _Stack | None:
        """The stack of `layout` on this rank (collective over the world: the layout's groups); None outside it."""
        pgc = self._pgs.collection(layout, self.rank)
        if pgc is None:
            return None
        return _Stack(self.args, self.hp, layout, self.rank, self.padded_vocab, self.dtype, self.device, self.seed,
                      None if weights == "empty" else weights, pgc, self.layer_spec.transformer_engine)

    @property
    def member(self) -> bool:
        return self.stack is not None

    @property
    def coord(self) -> tuple[int, int] | None:
        return self.layout.coord(self.rank)

    def sync_layout(self, layout: Layout | None) -> None:
        """A rank outside the actor that sat out member-local reshards learns the current layout (it holds no
        state, so nothing moves)."""
        self.layout = synced_layout(self.layout, layout, self.stack is not None, self.rank)

    @property
    def model(self) -> GPTAdapter | None:
        """The policy on this rank; None outside the layout or while its weights are offloaded."""
        return self.stack.adapter if self.stack is not None and "weight" not in self.offloaded else None

    def _stack(self) -> _Stack:
        if self.stack is None:
            raise RuntimeError(f"rank {self.rank} is not in the megatron actor's layout {self.layout}")
        return self.stack

    def inventory(self) -> tuple[ParamSpec, ...]:
        return self.specs

    # ---- training ------------------------------------------------------------------------------------
    def _claim(self, source) -> tuple[int, Any] | None:
        st, lay = self._stack(), self.layout
        dynamic = getattr(source, "dynamic", False) and st.tp_group is not None
        got = source.claim(st.d, lay.dp) if (st.t == 0 or not dynamic) else None
        if not dynamic:
            return got
        idx = torch.tensor([got[0] if got is not None else -1], dtype=torch.int64, device=self.device)
        dist.broadcast(idx, src=lay.device(0, st.d), group=st.tp_group)
        i = int(idx.item())
        if i < 0:
            return None
        return got if got is not None else (i, source.items[i])

    def forward_backward(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> tuple[float, int]:
        """Zero the grad buffer, run the iter's micro-batches, sync grads over DP (reduce-scatter: each rank's
        owned ranges of `param.main_grad` hold the DP sum). Returns (this rank's loss sum, micro-batches run)."""
        st = self._stack()
        t0 = time.perf_counter()
        st.ddp.zero_grad_buffer()
        st.opt.zero_grad()
        losses = []
        while (item := self._claim(source)) is not None:
            loss = loss_fn(st.adapter, item[1], num_tokens_in_iter)
            loss.backward()
            losses.append(loss.detach().double())
        t1 = time.perf_counter()
        with mc.optimizer_shim():
            st.ddp.finish_grad_sync()
            if st.tp_group is not None and self.args.qk_norm:
                # q/k_layernorm weights are TP-replicated but each rank normalizes only its own heads: sum their
                # grads over TP, as Megatron-LM's finalize_model_grads does (ours: RMSNorm(grad_group=tp))
                from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
                _allreduce_non_tensor_model_parallel_grads([st.ddp], st.cfg, st.tp_group)
        self._phases = {"compute": t1 - t0, "sync": time.perf_counter() - t1}
        return float(torch.stack(losses).sum()) if losses else 0.0, len(losses)

    def train_iter(self, source, loss_fn: Callable, num_tokens_in_iter: int) -> IterReport | None:
        """One optimizer step over the iter's queue (collective over the layout). None on ranks outside it."""
        if self.stack is None:
            return None
        self._require_resident("train_iter")
        start = time.perf_counter()
        st = self.stack
        loss, n = self.forward_backward(source, loss_fn, num_tokens_in_iter)
        t_update = time.perf_counter()
        lr = lr_at(self.hp, self.step)
        for dopt in st.dopts:
            for group in dopt.optimizer.param_groups:
                group["lr"], group["weight_decay"] = lr, self.hp.weight_decay
        with mc.optimizer_shim():
            ok, grad_norm, _ = st.opt.step()
        if not ok or not torch.isfinite(torch.tensor(grad_norm)) or not torch.isfinite(torch.tensor(loss)):
            # megatron-core's optimizer has applied the update when the norm is non-finite without a loss scaler:
            # the run stops here (the config refuses actor.on_nonfinite: skip with this backend)
            raise TrainingError("actor.on_nonfinite", self.hp.on_nonfinite, f"optimizer step {self.step} has "
                                f"gradient norm {grad_norm} and loss {loss} on rank {self.rank} (megatron backend)",
                                "resume from the last good checkpoint with a lower actor.lr or actor.grad_clip")
        self.step += 1
        self.data_cursor += len(source) if hasattr(source, "__len__") else 0
        loss_t = torch.tensor([loss], dtype=torch.float64, device=self.device)
        if st.dp_group is not None:
            dist.all_reduce(loss_t, group=st.dp_group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # the distributed optimizer's step also all-gathers the new params over DP: "update" holds the publish
        phases = {**self._phases, "update": time.perf_counter() - t_update}
        return IterReport(float(loss_t.item()), float(grad_norm), lr, float(grad_norm) > self.hp.grad_clip, n,
                          time.perf_counter() - start, phases)

    # ---- resharding ----------------------------------------------------------------------------------
    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None, *, local: bool = False,
                old_layout: Layout | None = None, prepared: Any = None) -> ReshardReport:
        """Move the full state to `new_layout` (collective over the world); see module doc.

        `local=True`: only the ranks of the old or the new layout call this, and its collectives run over the group
        of those ranks (`GroupCache.union`); every group it needs must exist already (`reshard_rank_sets`, made by
        `groups.ensure` or an earlier world-wide reshard), else LayoutError and nothing moves, as `ActorShard`'s.
        `old_layout`: the layout as the caller knows it (a rank that sat out local reshards catches up first).
        `prepared` (the native executor's programs) is not used: the plan is made here."""
        check_layout(self.args, self.padded_vocab, new_layout)
        self._require_resident("reshard")
        self.sync_layout(old_layout)
        if local:
            missing = [r for r in reshard_rank_sets(self.layout, new_layout) if not self.groups.has(r)]
            if missing:
                raise LayoutError("reshard", f"{self.layout} -> {new_layout}", f"a member-local reshard needs "
                                  f"groups not made yet: {missing[:3]}", "reshard world-wide once (local=False)")
            if self.rank not in new_layout.devices and self.rank not in self.layout.devices:
                raise LayoutError("reshard", f"{self.layout} -> {new_layout}", f"rank {self.rank} is in neither "
                                  "layout of a member-local reshard", "call it on the ranks of either layout only")
        # the collectives' group: the world, or the ranks of either layout (a one-rank union: that rank's own)
        group = (self.groups.union(self.layout, new_layout) or self._pgs.single[self.rank]) if local else None
        old_layout, old = self.layout, self.stack
        report = ReshardReport(old_layout, new_layout, ok=False)
        t0 = time.perf_counter()
        error = None

        def phase(name: str) -> None:
            nonlocal error
            if fault is not None and error is None:
                try:
                    fault(name)
                except Exception as e:
                    error = f"{name}: {type(e).__name__}: {e}"

        phase("plan")
        # step and data cursor advance on the layout's ranks only: the old layout's first rank tells the others
        scalars = torch.tensor([self.step, self.data_cursor], dtype=torch.int64, device=self.device)
        dist.broadcast(scalars, src=old_layout.devices[0], group=group)
        self.step, self.data_cursor = (int(v) for v in scalars.tolist())
        old_views = old.views(self.specs, self.step) if old is not None else None
        old_ranges = gather_ranges(old_views.ranges() if old_views is not None else None, len(self.specs),
                                   self.device, group)
        new = self._build(new_layout, None)  # the layout's groups (made world-wide on first use); then voted on
        new_views = None
        if new is not None:
            new.set_step(self.step)
            new_views = new.views(self.specs, self.step)
        new_ranges = gather_ranges(new_views.ranges() if new_views is not None else None, len(self.specs),
                                   self.device, group)
        phase("allocate")
        plan = None
        try:
            plan = plan_state(old_layout, new_layout, self.specs, old_ranges, new_ranges)
        except Exception as e:
            error = error or f"plan: {type(e).__name__}: {e}"
        if _vote(error is None, self.device, group):
            p_bytes = torch.empty((), dtype=self.dtype).element_size()
            plan = cast(ReshardPlan, plan)  # every rank planned (no error)
            report.bytes_moved = plan.bytes_moved(p_bytes)
            report.bytes_sent, report.bytes_received = execute_state(
                plan, old_views, new_views, self.rank, self.dtype, self.device)
            phase("transfer")
            phase("commit")
        ok = _vote(error is None, self.device, group)
        report.seconds = time.perf_counter() - t0
        if not ok:  # the old stack is untouched (no global state to restore); the new one is dropped
            report.error = error or "another rank voted to abort"
            raise ReshardError(report)
        self.stack, self.layout = new, new_layout
        report.ok = True
        return report

    # ---- views -------------------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict_global(self, over_layout: bool = False) -> dict[str, torch.Tensor]:
        """Every tensor in global Megatron coordinates on every rank (collective over the world, or with
        `over_layout` over the layout's ranks only, where the others return {}): param/<spec> (as fp32),
        master|exp_avg|exp_avg_sq/<spec>, step (owned ranges summed from their single owner; ranks outside the
        layout add zeros)."""
        if over_layout and self.stack is None:
            return {}
        with self._resident():
            return self._state_dict_global(over_layout)

    def _state_dict_global(self, over_layout: bool) -> dict[str, torch.Tensor]:
        group = self.groups.get(self.layout).all if over_layout else None
        reduce = not over_layout or group is not None   # a one-rank layout holds everything itself
        keys = [(i, k) for i in range(len(self.specs)) for k in ("param", "master", "exp_avg", "exp_avg_sq")]
        sizes = [self.specs[i].numel for i, _ in keys]
        flat = torch.zeros(sum(sizes), dtype=torch.float32, device=self.device)
        fulls = [part.view(self.specs[i].shape) for part, (i, _) in zip(flat.split(sizes), keys)]
        if self.stack is not None:
            self._fill_global(keys, fulls)
        if reduce:
            dist.all_reduce(flat, group=group)  # each element has exactly one non-zero contributor: the sum is exact
        out = {f"{k}/{self.specs[i].name}": full for (i, k), full in zip(keys, fulls)}
        out["step"] = torch.tensor(self.step if self.stack is not None else 0)
        if reduce:
            dist.all_reduce(out["step"], op=dist.ReduceOp.MAX, group=group)  # layout ranks hold it (others lag)
        return out

    def _fill_global(self, keys: list[tuple[int, str]], fulls: list[torch.Tensor]) -> None:
        st = self._stack()
        views = st.views(self.specs, self.step)
        lay, t, d = self.layout, st.t, st.d
        for (i, kind), full in zip(keys, fulls):
            spec = self.specs[i]
            if spec.tp_dim is None and t > 0:
                continue  # TP-replicated: t = 0's copy only
            shard = full[spec.tp_slices(lay.tp, t)]
            if kind == "param":
                if d == 0:
                    shard.copy_(views.params[i])
            elif views.opt[i] is not None:
                lo, hi, *bufs = cast(OptView, views.opt[i])
                piece = torch.zeros(shard.numel(), dtype=torch.float32, device=self.device)
                piece[lo:hi] = bufs[("master", "exp_avg", "exp_avg_sq").index(kind)]
                shard.copy_(piece.view(shard.shape))

    def export_megatron(self) -> ExportedWeights | None:
        """TP-local weights in GPTModel terms (specs = `inventory()`; fc1 halves are views); None outside the
        layout."""
        if self.stack is None:
            return None
        views = self.stack.views(self.specs, self.step)
        return ExportedWeights(self.layout.tp, self.stack.t, self.specs,
                               {s.name: p for s, p in zip(self.specs, views.params)})

    @torch.no_grad()
    def gather_replica(self) -> dict[str, torch.Tensor] | None:
        """Our global weights (the engines' names, compute dtype, on this device; new tensors, never views of the
        actor's) on every rank of the layout: the TP shards of this rank's DP replica all-gathered over its TP
        group (collective over the layout), unfused and with the padded vocab rows dropped (`from_megatron`). None
        outside the layout."""
        if self.stack is None:
            return None
        with self._resident():
            return self._gather_replica(self.stack)

    def _gather_replica(self, st: _Stack) -> dict[str, torch.Tensor]:
        tp = self.layout.tp
        views = st.views(self.specs, self.step)
        full: dict[str, torch.Tensor] = {}
        for spec, local in zip(self.specs, views.params):
            if spec.tp_dim is not None and tp > 1:
                parts = [torch.empty_like(local) for _ in range(tp)]   # Megatron's splits are even
                dist.all_gather(parts, local.contiguous(), group=st.tp_group)
                local = torch.cat(parts, dim=spec.tp_dim)
            else:   # a copy: the params are views of DDP's buffer, which `offload(weight=True)` frees
                local = local.clone()
            full[spec.name] = local
        return from_megatron(_join_halves(full), self.args)

    def export_weights(self) -> ExportedWeights | None:
        """TP shard t of our weights (`param_specs` names and split, compute dtype) for the weight sync: cut from
        `gather_replica` (collective over the layout at TP > 1). None outside the layout."""
        whole = self.gather_replica()
        if whole is None:
            return None
        tp, t = self.layout.tp, cast(_Stack, self.stack).t
        specs = tuple(param_specs(self.args))
        return ExportedWeights(tp, t, specs, {s.name: whole[s.name][s.tp_slices(tp, t)] for s in specs})

    def program_inputs(self) -> None:
        """None: the driver prepares no program; `reshard` plans the moves on the ranks."""
        return None

    # ---- memory (devices shared with generation) ----------------------------------------------------
    def _buffers(self) -> list:
        st = cast(_Stack, self.stack)
        return st.ddp.buffers + st.ddp.expert_parallel_buffers

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        """The optimizer's own device tensors: main-param shards not aliasing a param buffer, and Adam moments."""
        st = cast(_Stack, self.stack)
        params = {b.param_data.untyped_storage().data_ptr() for b in self._buffers() if b.param_data is not None}
        out = []
        for name, (_, _, main) in st.main.items():
            if main.untyped_storage().data_ptr() not in params:
                out.append(main)
            out.extend(st.moments(name, self.step))
        return out

    def offload(self, *, optimizer: bool, grad: bool, weight: bool) -> int:
        """Hand the device to generation (module doc); returns the bytes that left it. A no-op outside the layout
        or for what is off already; until `onload` this rank neither trains nor reshards."""
        if self.stack is None:
            return 0
        moved, pin = 0, self.device.type == "cuda"
        if optimizer and "optimizer" not in self.offloaded:
            for t in self._optimizer_tensors():
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                host.copy_(t)
                moved += t.numel() * t.element_size()
                t.data = host
            self.offloaded.add("optimizer")
        for kind, on in (("grad", grad), ("weight", weight)):
            if not on or kind in self.offloaded:
                continue
            for buf in self._buffers():
                data = buf.grad_data if kind == "grad" else buf.param_data
                if data is None:
                    continue
                n = data.untyped_storage().nbytes()
                if kind == "weight":   # the grad buffer holds nothing between iters: freed without a copy
                    host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=pin)
                    host.copy_(data)
                    self._host[id(buf)] = host
                self._sizes[(id(buf), kind)] = data.untyped_storage().size()
                data.untyped_storage().resize_(0)
                moved += n
            self.offloaded.add(kind)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return moved

    def onload(self) -> int:
        """Back on the device what `offload` moved, bit for bit (the grad buffers zeroed); returns the bytes."""
        if self.stack is None or not self.offloaded:
            return 0
        moved = 0
        if "optimizer" in self.offloaded:
            for t in self._optimizer_tensors():
                dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                dev.copy_(t, non_blocking=True)
                moved += t.numel() * t.element_size()
                t.data = dev
        for kind in ("grad", "weight"):
            if kind not in self.offloaded:
                continue
            for buf in self._buffers():
                data = buf.grad_data if kind == "grad" else buf.param_data
                if data is None:
                    continue
                data.untyped_storage().resize_(self._sizes.pop((id(buf), kind)))
                if kind == "weight":
                    data.copy_(self._host.pop(id(buf)), non_blocking=True)
                else:
                    data.zero_()
                moved += data.numel() * data.element_size()
        self.offloaded.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return moved

    @contextmanager
    def _resident(self) -> Iterator[None]:
        """The state on the device for a read (a checkpoint, an export while the engines generate), then handed
        back as it was: the device holds it again meanwhile."""
        flags = set(self.offloaded)
        if flags:
            self.onload()
        try:
            yield
        finally:
            if flags:
                self.offload(optimizer="optimizer" in flags, grad="grad" in flags, weight="weight" in flags)

    def _require_resident(self, op: str) -> None:
        if self.offloaded:
            raise RuntimeError(f"megatron actor rank {self.rank}: {op} while {sorted(self.offloaded)} are offloaded "
                               "(onload first)")

    def held_bytes(self) -> int:
        """DDP's param and grad buffers, fp32 main params and Adam moments of this rank, wherever they are."""
        if self.stack is None:
            return 0
        n = sum(t.numel() * t.element_size() for buf in self._buffers() for t in (buf.param_data, buf.grad_data)
                if t is not None)
        return n + sum(t.numel() * t.element_size() for t in self._optimizer_tensors())

    def resident_bytes(self) -> int:
        """What of `held_bytes` is on the device (what `offload` leaves)."""
        if self.stack is None:
            return 0
        n = sum(t.untyped_storage().nbytes() for buf in self._buffers() for t in (buf.param_data, buf.grad_data)
                if t is not None)
        if "optimizer" not in self.offloaded:
            n += sum(t.numel() * t.element_size() for t in self._optimizer_tensors())
        return n

    # ---- run checkpoints (the native format) --------------------------------------------------------
    @torch.no_grad()
    def _global_ours(self, over_layout: bool) -> dict[str, dict[str, torch.Tensor]]:
        """kind -> our global tensors (fp32) of this backend's state, kinds "param" and OPT_KINDS."""
        g = self.state_dict_global(over_layout=over_layout)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for kind in ("param",) + OPT_KINDS:
            meg = {spec.name: g[f"{kind}/{spec.name}"] for spec in self.specs}
            out[kind] = from_megatron(_join_halves(meg), self.args)
        return out

    def _native_twin(self, layout: Layout) -> ActorShard:
        """An `ActorShard` at `layout` on this rank, its state unset (collective over the world only for a layout
        whose groups are new)."""
        return ActorShard(self.args, self.hp, layout, self.rank, self.seed, self.device, self.dtype,
                          groups=self.groups, weights="empty")

    def save_checkpoint(self, tmp: str | Path, meta: CheckpointMeta) -> ShardRecord | None:
        """This rank's shard of a run checkpoint in the native format and, when the layout spans the world, the
        same state in megatron-core's format under `<tmp>/megatron/` (module doc; collective over the layout)."""
        if self.stack is None:
            return None
        ours = self._global_ours(over_layout=True)
        twin = self._native_twin(self.layout)
        try:
            st = cast(ShardState, twin.state)
            st.step, st.data_cursor = self.step, self.data_cursor
            _fill_shard(twin, ours)
            record = save_shard(twin, tmp, meta)
        finally:
            twin.free()
        if spans_world(self.layout):
            self._save_state(Path(tmp) / MEGATRON_DIR)
        elif self.rank == self.layout.devices[0]:
            log.info("run checkpoint %s: no megatron-format copy (layout %s is not the whole world of %d ranks in "
                     "order, which megatron-core's dist_checkpointing needs); the native shards hold the full state",
                     tmp, self.layout, dist.get_world_size())
        return record

    def load_checkpoint(self, gen: str | Path, layout: Layout, ranks: tuple[int, ...] | None = None
                        ) -> CheckpointLoad:
        """Every world rank: this backend's state from a run-checkpoint generation at `layout` (module doc): its
        megatron-format copy when it has one and `layout` spans the world, else its native shards. A failed read
        leaves every rank's state as it was (a vote) and raises. Its groups span the whole world: `ranks` (a world
        that lost ranks) is refused."""
        if ranks is not None:
            raise NotImplementedError("the megatron backend loads over the whole world only; a world that lost "
                                      "ranks restarts with new workers (TrainingRun.restart)")
        check_layout(self.args, self.padded_vocab, layout)
        copy = Path(gen) / MEGATRON_DIR
        if spans_world(layout) and (copy / "metadata.json").is_file():
            m = read_manifest(gen)   # the marker and the manifest: the generation is complete
            loaded = self._load_state(copy, layout, reset_optimizer=True)
            if loaded.optimizer != "checkpoint":
                raise CheckpointError("checkpoint", str(copy), "holds weights without the optimizer state a run "
                                      "checkpoint's megatron copy always has", f"remove {copy} to load the native "
                                      "shards, or resume from another generation")
            if self.data_cursor != m.data_cursor or self.step != m.optimizer_step:
                raise CheckpointError("checkpoint", str(copy), f"is at step {self.step}, data cursor "
                                      f"{self.data_cursor}; the manifest says {m.optimizer_step}, {m.data_cursor}",
                                      f"remove {copy} to load the native shards")
            return loaded
        self.onload()   # the loaded state is built on the device, as the native actor's
        twin = self._native_twin(self.layout)
        try:
            m = load_actor(twin, gen, layout)
            g = twin.state_dict_global()   # collective over the world
        finally:
            twin.free()
        if layout != self.layout or self.stack is None:   # built with grad mode on: DDP hooks its grad accumulators
            self.stack = self._build(layout, None)
            self.layout = layout
        self.step, self.data_cursor = int(g["step"]), int(g["data_cursor"])
        if self.stack is not None:
            self._set_state(g)
        return CheckpointLoad(self.stack is not None, self.step if self.stack else m.optimizer_step,
                              self.data_cursor if self.stack else m.data_cursor, self.held_bytes())

    @torch.no_grad()
    def _set_state(self, g: dict[str, torch.Tensor]) -> None:
        """This rank's params, main params and moments from our global tensors `g` (keys kind/<name>)."""
        st = cast(_Stack, self.stack)
        st.set_step(self.step)
        names = [s.name for s in param_specs(self.args)]
        meg = {kind: _split_halves(to_megatron({n: g[f"{kind}/{n}"] for n in names}, self.args, self.padded_vocab))
               for kind in ("param",) + OPT_KINDS}
        views = st.views(self.specs, self.step)
        tp, t = self.layout.tp, st.t
        for i, spec in enumerate(self.specs):
            views.params[i].copy_(meg["param"][spec.name][spec.tp_slices(tp, t)])
            opt = views.opt[i]
            if opt is None:
                continue
            lo, hi, *bufs = opt
            for kind, buf in zip(OPT_KINDS, bufs):
                buf.copy_(meg[kind][spec.name][spec.tp_slices(tp, t)].reshape(-1)[lo:hi])

    def grads(self) -> dict[str, torch.Tensor]:
        """TP-local fp32 grads after `forward_backward` (module names; at DP > 1 only owned ranges are summed)."""
        return {name: p.main_grad for name, p in self._stack().params.items()}

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path:
        """Weights and distributed-optimizer state (fp32 main params, Adam moments, step) through megatron-core's
        dist_checkpointing, Megatron-LM's keys (tidal/engine/backends/megatron_state_ckpt.py). Collective over the
        world; the layout must span it."""
        if padded_vocab not in (None, self.padded_vocab):
            raise LayoutError("padded_vocab", padded_vocab, f"the megatron backend's model is padded to "
                              f"{self.padded_vocab}", "omit padded_vocab")
        require_whole_world(self.layout)
        return self._save_state(Path(ckpt_dir))

    def _save_state(self, path: Path) -> Path:
        st = self._stack()
        with self._resident():
            st.set_step(self.step)   # every param has its Adam state (megatron-core reads one step per param)
            return save_state(st, self.layout, path, self.step, self.data_cursor)

    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> CheckpointLoad:
        """Weights of a dist_checkpointing checkpoint (any writer layout, by megatron-core or by us) and, when it
        holds them, fp32 main params, Adam moments and step, at this backend's layout. A weights-only checkpoint
        resets the moments and step (`reset_optimizer`, the default) or keeps this actor's; the returned
        `optimizer` says which. Collective over the world; the layout must span it."""
        return self._load_state(Path(ckpt_dir), self.layout, reset_optimizer)

    def _load_state(self, path: Path, layout: Layout, reset_optimizer: bool) -> CheckpointLoad:
        """`load_megatron` at `layout`: read into a new stack, vote over the world, then adopt it (a failed read
        leaves every rank's state as it was)."""
        require_whole_world(layout)
        self.onload()
        # every rank is in a whole-world layout; built with grad mode on (DDP hooks its grad accumulators)
        new = cast(_Stack, self._build(layout, None))
        with torch.no_grad():
            return self._adopt(new, path, layout, reset_optimizer)

    def _adopt(self, new: _Stack, path: Path, layout: Layout, reset_optimizer: bool) -> CheckpointLoad:
        new.set_step(0)
        got, error = None, None
        try:
            got = load_state(new, layout, path, 0)
        except Exception as e:   # reported through the vote so no peer adopts a state this rank could not read
            error = e
        if not _vote(error is None, self.device):
            raise error or CheckpointError("checkpoint", str(path), "was not read by another rank (its error is "
                                           "on that rank)", "fix that rank's error and load again")
        got = cast(StateLoad, got)
        opt: Literal["checkpoint", "reset", "kept"] = "checkpoint"
        if got.optimizer:
            self.step = cast(int, got.optimizer_step)
            new.set_step(self.step)
        else:   # weights only: main params from the weights; moments zero (as built) or the actor's own
            for name, (lo, hi, main) in new.main.items():
                main.copy_(new.params[name].data.reshape(-1)[lo:hi].float())
            keep = not reset_optimizer and self.stack is not None and layout == self.layout
            if keep:
                old = cast(_Stack, self.stack)
                for name in new.main:
                    for dst, src in zip(new.moments(name, self.step), old.moments(name, self.step)):
                        dst.copy_(src)
            self.step = self.step if keep else 0
            opt = "kept" if keep else "reset"
            new.set_step(self.step)
        if got.data_cursor is not None:
            self.data_cursor = got.data_cursor
        self.stack, self.layout = new, layout
        return CheckpointLoad(True, self.step, self.data_cursor, self.held_bytes(), opt, "megatron")


def _join_halves(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Spec-named tensors (fc1 as `#gate` / `#up` halves) -> GPTModel module names ([gate; up] rows)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        base, _, half = name.partition("#")
        if half == "up":
            continue
        out[base] = torch.cat([w, state[base + "#up"]]) if half == "gate" else w
    return out


def _split_halves(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `_join_halves`."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if name.endswith(FC1):
            out[name + "#gate"], out[name + "#up"] = w.chunk(2)
        else:
            out[name] = w
    return out


@torch.no_grad()
def _fill_shard(shard: ActorShard, ours: dict[str, dict[str, torch.Tensor]]) -> None:
    """`shard`'s params (TP shard) and owned optimizer ranges from our global tensors per kind."""
    st = cast(ShardState, shard.state)
    t = cast("tuple[int, int]", shard.coord)[0]
    for i, spec in enumerate(shard.specs):
        local = {k: ours[k][spec.name][spec.tp_slices(shard.layout.tp, t)].reshape(-1) for k in ours}
        st.param(i).copy_(local["param"].view(st.param(i).shape))
        lo, hi = st.shape.owned[i]
        o = st.shape.opt_offsets[i]
        for kind in OPT_KINDS:
            st.buffer(kind)[o:o + hi - lo].copy_(local[kind][lo:hi])


def _set_tp_attributes(params: dict[str, nn.Parameter], args: ModelArgs, padded_vocab: int) -> None:
    """The `tensor_model_parallel` / `partition_dim` / `partition_stride` attributes megatron-core 0.16.1 sets on
    TP-split weights only inside its init functions, i.e. not with perform_initialization=False (linear biases do
    get them). The optimizer reads them (`param_is_not_tensor_parallel_duplicate`): without them every TP-split
    weight counts in the grad norm on TP rank 0 only, and clipping at TP > 1 uses a wrong norm. Set as megatron-core
    sets them with initialization (stride 2 for the fused SwiGLU fc1); replicated norms stay unmarked, as there."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    tp_dim = {s.name.partition("#")[0]: s.tp_dim for s in megatron_specs(args, padded_vocab)}
    for name, p in params.items():   # local-spec names
        if tp_dim[name] is not None and not getattr(p, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(p, True, tp_dim[name], 2 if name.endswith(FC1) else 1)


def _vote(ok: bool, device, group=None) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


register_backend("megatron", MegatronBackend)

__all__ = ["MegatronBackend", "GPTAdapter"]
