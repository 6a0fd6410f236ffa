"""Fused kernels for the CUDA engine: fewer, larger launches per decode step, the same math.

A decode step of a 1.5B model at batch 64 moves about 4.5 GB (weights and KV) but launched ~46 kernels per
layer in eager mode, most of them elementwise ops on a [64, hidden] activation (the norms' seven, RoPE's four
per tensor, SiLU and its product, the residual adds), each costing a few microseconds however little it moves.
Two changes bring the layer to about a dozen launches:

- packed projections: q/k/v and gate/up of a layer are one GEMM each (`Transformer.pack_projections`; the
  parameters stay views of the packed weights, so weight updates land in both);
- compiled elementwise stages: `torch.compile` (Inductor, Triton on CUDA) turns each of the model's elementwise
  functions (`rms_norm`, `add_rms_norm`, `rope_qk`, `silu_mul` in `tidal.engine.model`) into one fused kernel,
  compiled once with dynamic shapes and shared by every layer, every engine of the process and the captured CUDA
  graphs (compiled on the warm-up forward, before a capture).

Numerics: the fused stages round once at their end where eager rounds after each op, and a packed GEMM may
round differently from three, so `fused=1` is part of an engine's `numerics`; KV moves only between engines that
agree. A scorer that shares the engine's model computes with the eager kernels and separate projections.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from tidal.engine.model import Kernels, add_rms_norm, rms_norm, rope_qk, silu_mul


def available(device: torch.device) -> bool:
    """Fused kernels run here: a CUDA device with Triton installed."""
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


@functools.cache
def pdl(device: torch.device) -> bool:
    """Our Triton kernels launch with programmatic dependent launch here (Hopper or newer, a Triton with grid
    dependency control, not the interpreter): a kernel's programs start while the previous kernel finishes and
    wait (`gdc_wait`) before they read what it wrote, which hides a launch's ramp-up and the previous kernel's
    tail. Before that wait a kernel reads only what no kernel of the step writes (a GEMM's weights)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """The launch keywords of one of our Triton kernels on `device`: its `PDL` constexpr (whether it calls
    `gdc_launch_dependents` / `gdc_wait`) and, where `pdl` holds, Triton's `launch_pdl`."""
    on = pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def compiled_kernels() -> Kernels:
    """The model's elementwise stages compiled (one per process; Inductor compiles on first call)."""
    def fuse(fn):
        return torch.compile(fn, dynamic=True, fullgraph=True)
    return Kernels(packed=True, rms_norm=fuse(rms_norm), add_rms_norm=fuse(add_rms_norm), rope_qk=fuse(rope_qk),
                   silu_mul=fuse(silu_mul))
