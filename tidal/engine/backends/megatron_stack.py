"""One layout's megatron-core objects on one rank (`Stack`): GPTModel, DDP and DistributedOptimizer, the views
the reshard and the checkpoints read, and the hand-over of their memory to generation.

What a rank of layout (tp, dp) builds::

    process groups      a `ProcessGroupCollection` of the layout's TP / DP / all-ranks groups
                        (tidal/engine/backends/megatron_groups.py), passed to GPTModel, DDP and the optimizer;
                        megatron-core's global parallel_state is never initialized for training
    GPTModel            megatron-core's local layer spec, or its Transformer Engine spec (`transformer_engine`;
                        q/k_layernorm with qk_norm), TransformerConfig from our ModelArgs
                        (`megatron_map.transformer_config`: head_dim, qkv_bias, qk_norm, RoPE scaling),
                        calculate_per_token_loss=True (see DDP below); built without megatron's init
                        (perform_initialization=False), so the TP attributes its init would set on the split
                        weights are set by `megatron_convert.set_tp_attributes` (the optimizer's grad norm reads
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

Memory hand-over (`offload` / `onload`, devices shared with generation): `optimizer` moves the fp32 main-param
shards that are tensors of their own (bf16 params; fp32 params' shards are views of the param buffer and go with
it) and the Adam moments to host memory (pinned on CUDA), each tensor object kept (its `.data` swapped), so the
optimizer, the range index and the reshard views stay bound; `grad` frees DDP's grad buffers (storage resized to
0, megatron-core's `offload_grad_buffers`; every `main_grad` view stays a view and is zeroed on restore, as
before every iter); `weight` copies DDP's param buffers out and frees them the same way. `onload` restores each
bit for bit.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from tidal.engine.backends import megatron_cpu as mc
from tidal.engine.backends.megatron_convert import set_tp_attributes
from tidal.engine.backends.megatron_groups import init_process_state, layout_gather
from tidal.engine.backends.megatron_map import (
    gpt_layer_spec,
    gpt_model_kwargs,
    local_param_name,
    megatron_tp_shard,
    to_megatron,
    transformer_config,
)
from tidal.engine.backends.megatron_state_reshard import OptView, StateViews, split_unit_range
from tidal.engine.layout import Layout, ParamSpec
from tidal.engine.model import ModelArgs
from tidal.engine.optim import OptimConfig
from tidal.engine.tp import vocab_parallel_logprobs


class GPTAdapter(nn.Module):
    """GPTModel (through its DDP wrapper) with our model's `token_logprobs`: fp32 log-probs of the real vocab (the
    padded columns are masked out of the softmax), so loss functions written for our Transformer run unchanged."""

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


class Stack:
    """parallel_state + GPTModel + DDP + DistributedOptimizer of one layout on one rank (module doc)."""

    def __init__(self, args: ModelArgs, hp: OptimConfig, layout: Layout, rank: int, padded_vocab: int,
                 dtype: torch.dtype, device: torch.device, seed: int, weights: dict[str, torch.Tensor] | None,
                 pgc: Any, transformer_engine: bool = False):
        mc.import_megatron()
        from megatron.core.tensor_parallel import random as mrandom

        init_process_state()
        self.layout, self.t, self.d = layout, *cast("tuple[int, int]", layout.coord(rank))  # a rank of the layout
        self.device = device
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
        set_tp_attributes(self.params, args, padded_vocab)
        local = None
        if weights is not None:
            local = megatron_tp_shard(to_megatron(weights, args, padded_vocab), args, tp, self.t)
            self._load_weights(model, local, transformer_engine)
        self._wrap(model, cfg, hp, dtype, pgc)
        tp_group = pgc.tp if tp > 1 else None
        self.dp_group = pgc.dp if layout.dp > 1 else None
        self.tp_group = tp_group
        self.adapter = GPTAdapter(self.ddp, args.vocab_size, padded_vocab, tp, self.t, tp_group, device)
        self._index_optimizer()
        if local is not None:  # fp32 main params from the fp32 weights (ActorShard's masters), not the cast params
            with torch.no_grad():
                for name, (lo, hi, main) in self.main.items():
                    main.copy_(local[name].reshape(-1)[lo:hi].to(main))
        # what `offload` moved ("optimizer", "grad", "weight") until `onload`: each buffer's storage size and the
        # host copy of its params
        self.offloaded: set[str] = set()
        self._sizes: dict[tuple[int, str], int] = {}
        self._host: dict[int, torch.Tensor] = {}

    def _load_weights(self, model, local: dict[str, torch.Tensor], transformer_engine: bool) -> None:
        """This rank's TP shard of the weights (GPTModel names) into the model."""
        if transformer_engine:
            with torch.no_grad():
                for name, p in self.params.items():
                    p.copy_(local[name])
        else:
            mc.load_gpt_weights(model, local)

    def _wrap(self, model, cfg, hp: OptimConfig, dtype: torch.dtype, pgc: Any) -> None:
        """DDP around the model and the DistributedOptimizer over it (module doc)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

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

    def fill_global(self, specs: tuple[ParamSpec, ...], step: int, keys: list[tuple[int, str]],
                    fulls: list[torch.Tensor]) -> None:
        """This rank's part of a state in global coordinates: `fulls[j]` is the zeroed global tensor of key
        (spec index, kind), kind "param" or master|exp_avg|exp_avg_sq; each element is written by one rank only
        (TP-replicated specs by t = 0, params by DP replica 0, optimizer ranges by their owner)."""
        views = self.views(specs, step)
        tp, t, d = self.layout.tp, self.t, self.d
        for (i, kind), full in zip(keys, fulls):
            spec = specs[i]
            if spec.tp_dim is None and t > 0:
                continue  # TP-replicated: t = 0's copy only
            shard = full[spec.tp_slices(tp, t)]
            if kind == "param":
                if d == 0:
                    shard.copy_(views.params[i])
            elif views.opt[i] is not None:
                lo, hi, *bufs = cast(OptView, views.opt[i])
                piece = torch.zeros(shard.numel(), dtype=torch.float32, device=self.device)
                piece[lo:hi] = bufs[("master", "exp_avg", "exp_avg_sq").index(kind)]
                shard.copy_(piece.view(shard.shape))

    # ---- memory (devices shared with generation) ----------------------------------------------------
    def buffers(self) -> list:
        """DDP's param-and-grad buffers."""
        return self.ddp.buffers + self.ddp.expert_parallel_buffers

    def optimizer_tensors(self, step: int) -> list[torch.Tensor]:
        """The optimizer's own device tensors: main-param shards not aliasing a param buffer, and Adam moments."""
        params = {b.param_data.untyped_storage().data_ptr() for b in self.buffers() if b.param_data is not None}
        out = []
        for name, (_, _, main) in self.main.items():
            if main.untyped_storage().data_ptr() not in params:
                out.append(main)
            out.extend(self.moments(name, step))
        return out

    def offload(self, optimizer: bool, grad: bool, weight: bool, step: int) -> int:
        """Hand the device to generation (module doc); returns the bytes that left it. A no-op for what is off
        already."""
        moved, pin = 0, self.device.type == "cuda"
        if optimizer and "optimizer" not in self.offloaded:
            for t in self.optimizer_tensors(step):
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                host.copy_(t)
                moved += t.numel() * t.element_size()
                t.data = host
            self.offloaded.add("optimizer")
        for kind, on in (("grad", grad), ("weight", weight)):
            if not on or kind in self.offloaded:
                continue
            for buf in self.buffers():
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

    def onload(self, step: int) -> int:
        """Back on the device what `offload` moved, bit for bit (the grad buffers zeroed); returns the bytes."""
        if not self.offloaded:
            return 0
        moved = 0
        if "optimizer" in self.offloaded:
            for t in self.optimizer_tensors(step):
                dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                dev.copy_(t, non_blocking=True)
                moved += t.numel() * t.element_size()
                t.data = dev
        for kind in ("grad", "weight"):
            if kind not in self.offloaded:
                continue
            for buf in self.buffers():
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

    def held_bytes(self, step: int) -> int:
        """DDP's param and grad buffers, fp32 main params and Adam moments, wherever they are."""
        n = sum(t.numel() * t.element_size() for buf in self.buffers() for t in (buf.param_data, buf.grad_data)
                if t is not None)
        return n + sum(t.numel() * t.element_size() for t in self.optimizer_tensors(step))

    def resident_bytes(self, step: int) -> int:
        """What of `held_bytes` is on the device (what `offload` leaves)."""
        n = sum(t.untyped_storage().nbytes() for buf in self.buffers() for t in (buf.param_data, buf.grad_data)
                if t is not None)
        if "optimizer" not in self.offloaded:
            n += sum(t.numel() * t.element_size() for t in self.optimizer_tensors(step))
        return n
