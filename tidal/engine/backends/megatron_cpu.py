"""Running megatron-core's GPTModel and dist_checkpointing without CUDA: the narrow workarounds, in one place.

megatron-core 0.16.1 is written for GPUs. Its parallel state runs on gloo as it is; a few call sites reach for
CUDA unconditionally. Each workaround below is the smallest one that lets the *unchanged* megatron-core code run
on CPU, and on a machine with CUDA every one of them is a no-op (`cpu_shim` patches nothing when CUDA is there):

| where (megatron-core 0.16.1)                                   | CUDA call                          | workaround
|----------------------------------------------------------------|------------------------------------|----------------
| RotaryEmbedding.get_emb (moves inv_freq to the GPU)            | torch.cuda.current_device()        | cpu_shim
| GlobalMemoryBuffer.get_tensor (attention scores buffer)        | torch.cuda.current_device()        | cpu_shim
| dist_checkpointing FileSystemWriterAsync.preload_tensors (D2H) | torch.cuda.synchronize()           | cpu_shim
| dist_checkpointing save_state_dict_async_finalize (fail flag)  | torch.cuda.current_device()        | cpu_shim
| fused_softmax default causal mask                              | torch.ones(..., device="cuda")     | pass an explicit
|   (utils.get_default_causal_mask)                              |                                    | `causal_mask`
| CudaRNGStatesTracker.fork around attention dropout             | torch.cuda RNG state               | megatron's own
|                                                                |                                    | inference
|                                                                |                                    | tracker (no
|                                                                |                                    | dropout here)
| param_and_grad_buffer._ParamAndGradBuffer (DDP param/grad bufs)| device=torch.cuda.current_device() | cpu_shim
| MixedPrecisionOptimizer.__init__ (optimizer.py:481, 485)       | torch.tensor(..., device='cuda')   | optimizer_shim
| clip_grads.get_grad_norm_fp32 / clip_grad_by_total_norm_fp32   | torch.zeros(..., device='cuda')    | optimizer_shim
| utils.local_multi_tensor_l2_norm (no Apex/TE: the torch path)  | torch.tensor(..., device='cuda')   | optimizer_shim
| DistributedOptimizer._build_model_and_main_param_groups (361,  | param.type() in                    | optimizer_shim
|   420), DistributedOptimizer.__init__ (582), clip_grads (167)  |   ['torch.cuda.FloatTensor', ...]  |

`cpu_shim()` swaps `torch.cuda.current_device` for a function that returns "cpu" (every use above is a `device=`
argument) and `torch.cuda.synchronize` for a no-op (there is no device to wait for), only for the duration of the
`with` block, and restores both on exit. It is not thread-safe: do not run other CUDA-probing code concurrently.

Not a CUDA shim, but a process rule: dist_checkpointing's writer forks one process per write bucket and opens a
multiprocessing Manager, so the saving process must be allowed to have children (not a daemonic process; torchrun
and Ray workers are not daemonic; tests use `run_ranks(..., daemon=False)`).

`optimizer_shim()` (cpu_shim plus a torch function mode, `_CudaToCpu`) lets megatron-core's DDP wrapper
(`overlap_grad_reduce=False`: no CUDA streams) and DistributedOptimizer (torch AdamW: no Apex/TE fused kernels) run
unchanged on gloo. Inside the block the mode rewrites three things and nothing else:
- a factory call's `device=` that names CUDA (a string, a torch.device or an index) becomes "cpu";
- `Tensor.cuda()` returns the tensor itself (it is already where the work happens);
- `Tensor.type()` without arguments on a CPU tensor answers the CUDA type name ("torch.FloatTensor" ->
  "torch.cuda.FloatTensor"): megatron-core classifies parameters by that string (fp32 vs fp16/bf16 main params,
  clip's fp32 check); the answer keeps the dtype, which is all those checks read.
The mode costs a Python call per torch op inside the block, so the backend uses it around optimizer construction
and `step()` only (forward/backward need just `cpu_shim`). Every site above is exercised by
tests/test_megatron_backend.py (a DDP + DistributedOptimizer step on gloo, compared with our engine).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from tidal.engine.backends.megatron_map import gpt_layer_spec, gpt_model_kwargs, transformer_config
from tidal.engine.model import ModelArgs


def _cpu_device() -> str:
    return "cpu"


def _no_sync(device=None) -> None:
    return None


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Route megatron-core's unconditional CUDA calls to the CPU inside the block (a no-op when CUDA exists)."""
    if torch.cuda.is_available():
        yield
        return
    cuda: Any = torch.cuda  # its functions are swapped for CPU stand-ins of other signatures
    saved = cuda.current_device, cuda.synchronize
    cuda.current_device, cuda.synchronize = _cpu_device, _no_sync
    try:
        yield
    finally:
        cuda.current_device, cuda.synchronize = saved


class _CudaToCpu(TorchFunctionMode):
    """See the module doc: CUDA placements -> CPU, `.cuda()` -> identity, `.type()` -> the CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dev = kwargs.get("device")
        if dev is not None and (isinstance(dev, int) or torch.device(dev).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def optimizer_shim() -> Iterator[None]:
    """`cpu_shim` plus `_CudaToCpu` (module doc), for megatron-core's DDP and DistributedOptimizer on CPU; a no-op
    when CUDA exists."""
    if torch.cuda.is_available():
        yield
        return
    with cpu_shim(), _CudaToCpu():
        yield


def import_megatron():
    """megatron.core, with its "Transformer Engine and Apex are not installed" import warnings silenced (we run
    the local spec, which needs neither). Raises ImportError with the install hint when it is missing."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core
            from megatron.core import parallel_state  # noqa: F401
    except ImportError as e:
        raise ImportError("megatron-core is not installed: pip install 'tidal[megatron]' "
                          "(megatron-core==0.16.1, psutil)") from e
    import megatron.core
    return megatron.core


def init_parallel(tp: int) -> None:
    """megatron-core's parallel state for TP = tp, PP = 1 over the initialized torch.distributed world (gloo on
    CPU), and its RNG tracker. The inference tracker's `fork()` is a no-op instead of a CUDA RNG swap; that is
    exact for our models, which have no dropout (the config sets both dropouts to 0)."""
    import_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    if not torch.cuda.is_available():
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def build_gpt(args: ModelArgs, tp: int, padded_vocab: int, dtype: torch.dtype = torch.float32, **config_overrides):
    """megatron-core GPTModel (local layer spec: no Transformer Engine; q/k_layernorm with `qk_norm`) for our
    model at TP = tp. Call `init_parallel(tp)` first."""
    import_megatron()
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = transformer_config(args, tp, dtype, **config_overrides)
    return GPTModel(cfg, gpt_layer_spec(args), **gpt_model_kwargs(args, padded_vocab))


def causal_mask(t: int, device=None) -> torch.Tensor:
    """Megatron's mask convention: [1, 1, T, T] bool, True = masked out (future positions)."""
    return torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)[None, None]


@torch.no_grad()
def gpt_logits(model, ids_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full-vocab logits [B, T, V] of GPTModel (vocab-parallel output gathered over its TP group, padded
    columns dropped)."""
    from megatron.core import parallel_state as ps

    b, t = ids_BT.shape
    pos = torch.arange(t, device=ids_BT.device).expand(b, t)
    with cpu_shim():
        local = model(ids_BT, pos, causal_mask(t, ids_BT.device))
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size]


@torch.no_grad()
def load_gpt_weights(model, state: dict[str, torch.Tensor]) -> None:
    """Copy TP-local GPTModel weights (module names, `megatron_tp_shard`) into `model`; every parameter must be
    given (only the layers' `_extra_state`, None for non-TE linears, may be absent)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise KeyError(f"GPTModel weights: missing {missing[:5]}, unexpected {unexpected[:5]}")


__all__ = ["cpu_shim", "optimizer_shim", "import_megatron", "init_parallel", "build_gpt", "causal_mask", "gpt_logits",
           "load_gpt_weights"]
