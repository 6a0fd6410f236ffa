"""Every check `tidal train` makes before a worker starts, in one place: `tidal validate` runs exactly these, so
a config that validates is one that starts (and one that does not start fails validation with the same error).

    inputs, kind = preflight(cfg, tracked=True, resume_from=None)

Checks, each a TidalError naming the field and the fix: what the pipeline can run (rollout and inference TP 1,
the native rollout engine, no KL-to-reference term),
the actor backend (`actor.backend: megatron` needs megatron-core importable here, and the model and actor TP in
what megatron-core can express), the model, tokenizer, prompts and verifier (`read_inputs`), the device kind
(`cuda` needs a GPU per device), the cores of `cluster.cpu_device_cores`, the memory every device will hold
(`tidal.pipeline.memory_plan`: each GPU's, or the host's for CPU devices), the database URL when the run is
tracked, and a resume checkpoint (marker, checksums, model, and that it leaves steps to train). Reads; writes
nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import torch

from db.session import parse_url
from tidal.core.config import TidalConfig
from tidal.core.errors import ConfigError, LayoutError
from tidal.engine.backends.megatron_map import check_megatron_args, check_megatron_tp
from tidal.engine.backends.protocol import BACKEND_NEEDS, backend_available
from tidal.engine.model import ModelArgs
from tidal.pipeline.checkpointing import check_resumable
from tidal.pipeline.inputs import RunInputs, read_inputs
from tidal.pipeline.memory_plan import check_memory


def check_runnable(cfg: TidalConfig) -> None:
    """What the streaming pipeline runs: a key it would ignore or fail on is refused here, not met mid-run."""
    if cfg.rollout.tensor_parallel_size != 1 or cfg.inference.tensor_parallel_size != 1:
        raise ConfigError("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size,
                          "the pipeline runs rollout and inference instances on one device each",
                          "set rollout/inference tensor_parallel_size: 1 (actor TP may be any size)")
    if cfg.rollout.backend != "native":
        raise ConfigError("rollout.backend", cfg.rollout.backend, "the pipeline's rollout runs Tidal's native engine "
                          "(the vLLM backend runs standalone, docs/vllm.md, and in `tidal simulate`'s costs)",
                          "set rollout.backend: native")
    if cfg.algorithm.kl_coef > 0:
        raise ConfigError("algorithm.kl_coef", cfg.algorithm.kl_coef, "the pipeline keeps no reference model, so no "
                          "KL-to-reference term can be formed", "set algorithm.kl_coef: 0")


def check_backend(cfg: TidalConfig, args: ModelArgs) -> None:
    """`actor.backend` can be built here for this model: its package is importable (no worker would start
    otherwise), and with megatron the model and the actor's TP size are what megatron-core 0.16.1 expresses."""
    name = cfg.actor.backend
    install = backend_available(name)
    if install is not None:
        raise ConfigError("actor.backend", name, f"needs {BACKEND_NEEDS[name][0]}, which is not importable in this "
                          "environment", f"{install} (or actor.backend: native)")
    if name == "megatron":
        try:
            check_megatron_args(args)
            check_megatron_tp(args, cfg.actor.tensor_parallel_size)
        except LayoutError as err:   # the same words, as the config key the user sets
            field = "actor.tensor_parallel_size" if err.field == "tp" else err.field
            raise ConfigError(field, err.value, f"{err.problem} (actor.backend: megatron)", err.fix) from None


def device_kind(cfg: TidalConfig) -> Literal["cpu", "cuda"]:
    """`cluster.device` resolved on this machine: `auto` is CUDA when there is a GPU for every device."""
    want = cfg.cluster.device
    n = cfg.cluster.num_devices
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and have < n:
        raise ConfigError("cluster.device", want, f"the placement needs {n} GPUs, this machine has {have}",
                          "use cluster.device: auto (CPU virtual devices) or a smaller placement")
    if want == "auto":
        return "cuda" if have >= n else "cpu"
    return want


def check_cores(cfg: TidalConfig, kind: str) -> None:
    cores = cfg.cluster.cpu_device_core_ids
    if kind == "cpu" and cores and cores[-1] >= (os.cpu_count() or 1):
        raise ConfigError("cluster.cpu_device_cores", cfg.cluster.cpu_device_cores,
                          f"names cores this machine lacks (it has 0-{(os.cpu_count() or 1) - 1})",
                          "pick cores among them, or drop the key")


Preflight = tuple[RunInputs, Literal["cpu", "cuda"]]   # what `preflight` found: the inputs, the device kind


#: bytes a parameter takes in a checkpoint generation, at most: the weight (fp32 or less), fp32 master, two Adam moments
CHECKPOINT_BYTES_PER_PARAM = 16


def check_host_copy(cfg: TidalConfig, num_params: int) -> Path:
    """`actor.redundancy: host`: the folder its copy goes under, refused when it is not writable or has no room
    for two generations (the new one is written before the old one is dropped)."""
    root = host_copy_root(cfg)
    need = 2 * CHECKPOINT_BYTES_PER_PARAM * num_params
    free = shutil.disk_usage(root).free
    if free < need:
        raise ConfigError("actor.redundancy_dir", cfg.actor.redundancy_dir,
                          f"{root} has {free / 2**30:.2f} GiB free; two copies of this run's state take up to "
                          f"{need / 2**30:.2f} GiB", "give a folder with that much room (a container's /dev/shm is "
                          "often 64 MB: raise it, e.g. docker --shm-size), or actor.redundancy: none")
    return root


def host_copy_root(cfg: TidalConfig) -> Path:
    """The folder `actor.redundancy: host` writes its copy under: actor.redundancy_dir, else /dev/shm (memory)
    where it is writable, else the system's temporary folder."""
    given = cfg.actor.redundancy_dir
    if given is None:
        shm = Path("/dev/shm")
        return shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    root = Path(given).expanduser()
    if not (root.is_dir() and os.access(root, os.W_OK | os.X_OK)):
        raise ConfigError("actor.redundancy_dir", given, "is not a writable folder",
                          "give an existing folder this user can write (memory-backed, e.g. /dev/shm, keeps the "
                          "copy fastest), or null")
    return root


def preflight(cfg: TidalConfig, *, tracked: bool, resume_from: str | Path | None = None) -> Preflight:
    """The run's inputs and device kind, after every check above (see the module doc)."""
    check_runnable(cfg)
    inputs = read_inputs(cfg)
    check_backend(cfg, inputs.args)
    kind = device_kind(cfg)
    check_cores(cfg, kind)
    check_memory(cfg, inputs.args, kind)
    if cfg.actor.redundancy == "host":
        check_host_copy(cfg, inputs.args.num_params())
    if tracked:
        parse_url(cfg.tracking.db_url)
    if resume_from is not None:
        gen, manifest = check_resumable(resume_from, inputs.args)
        if manifest.meta.step >= cfg.run.num_steps:
            raise ConfigError("run.num_steps", cfg.run.num_steps, f"leaves nothing to train after the checkpoint "
                              f"{gen}, saved at step {manifest.meta.step}",
                              f"raise run.num_steps past {manifest.meta.step} to train on")
    return inputs, kind
