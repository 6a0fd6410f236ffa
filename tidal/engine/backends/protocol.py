"""The actor backend protocol: what the pipeline asks of the training engine on one world rank.

The pipeline's actor role (tidal/workers/roles.py, roles_ckpt.py) drives an actor through these verbs and never
reaches inside it::

    member, coord, layout, groups           is this rank in the layout, its (t, d), the layout, the process-group
                                            cache the layouts' groups live in (made world-wide on first use)
    train_iter(source, loss_fn, num_tokens) one optimizer step over the iter's micro-batch queue
    model                                   the policy on this rank (`PolicyModel`: token log-probs, entropy)
    inventory()                             the state inventory the reshard planner plans from
    reshard(new, local=, old_layout=,       plan / execute / commit to another (tp, dp, devices); member-local
            prepared=)                      when every group it needs exists; `prepared` is the driver's program
    program_inputs()                        what the driver needs to prepare reshard programs (None: ranks plan)
    sync_layout(layout)                     a rank that sat out member-local reshards learns the layout
    export_weights()                        TP-local weights in the engines' names and TP split, compute dtype
    gather_replica()                        whole weights (engines' names, global shapes) on every layout rank
    offload(...) / onload()                 hand a shared device to generation and back (bytes moved)
    held_bytes() / resident_bytes()         this rank's actor memory, all of it / what is on the device
    save_checkpoint(tmp, meta)              this rank's part of a run checkpoint (tidal/engine/checkpoint.py)
    load_checkpoint(gen, layout, ranks)     the state of a run checkpoint at `layout` (collective over the world,
                                            or over `ranks`, its live ranks; two-phase)
    save_megatron(dir) / load_megatron(dir) megatron-core dist_checkpointing format: weights (native), weights and
                                            distributed-optimizer state (megatron); the load says what it restored

Every verb is collective over the world like `ActorShard`'s: every world rank calls it at the same point; ranks
outside the layout take part in group creation and votes and return None where a value is returned. The
exceptions are the member-local forms: `reshard(local=True)` (the ranks of either layout), `export_weights`,
`gather_replica` and `save_checkpoint` (the layout's ranks).

The weights the engines get are in *their* names and TP split (`tidal.engine.model.param_specs`) and the
actor's compute dtype, whatever the backend holds: a rollout or inference engine never sees a backend's own
layout (fused QKV, padded vocab rows).

A backend is picked by name (`actor.backend`), the one place users plug in, so there is a registry and it refuses
duplicates. Registered here: "native" (tidal/engine/backends/native.py, over `ActorShard`) and, when megatron-core is
importable, "megatron" (tidal/engine/backends/megatron_backend.py: GPTModel + megatron-core DDP + DistributedOptimizer).
`backend_available(name)` says whether a name can be built in this environment and, if not, what to install.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from tidal.core.errors import ConfigError
from tidal.engine.layout import Layout, ParamSpec

if TYPE_CHECKING:   # annotations only: the registry imports no torch-heavy engine module until a backend is built
    import torch

    from tidal.engine.actor import ExportedWeights, IterReport, MicrobatchSource
    from tidal.engine.checkpoint import CheckpointMeta, ShardRecord
    from tidal.engine.groups import GroupCache
    from tidal.engine.reshard import ReshardReport

#: backends and the Python package each needs beyond Tidal's own dependencies (with how to install it)
BACKEND_NEEDS = {"megatron": ("megatron.core", "pip install -e '.[megatron]'")}


@runtime_checkable
class PolicyModel(Protocol):
    """The policy a loss function and the actor's own scoring call (our Transformer; Megatron's GPTAdapter)."""

    def token_logprobs(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]): [B, T-1], fp32."""
        ...

    def token_logprobs_entropy(self, ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`token_logprobs`, the entropy of each position's distribution without grad)."""
        ...


@dataclass(frozen=True)
class ProgramInputs:
    """What the driver needs to prepare the native executor's reshard programs
    (`tidal.engine.reshard.commit.prepare_programs`) for this actor."""

    specs: tuple[ParamSpec, ...]
    """The actor's param specs (`inventory()`)."""
    param_bytes: int
    """Bytes of one parameter element (the compute dtype)."""
    bucket_bytes: int
    """The executor's message bucket size."""


@dataclass(frozen=True)
class CheckpointLoad:
    """One rank's account of `load_checkpoint`."""

    in_layout: bool
    """This rank holds state at the loaded layout."""
    optimizer_step: int
    """The optimizer step (LR schedule position) the state continues from."""
    data_cursor: int
    """Micro-batches consumed, as saved."""
    held_bytes: int
    """This rank's actor bytes after the load."""
    optimizer: Literal["checkpoint", "reset", "kept"] = "checkpoint"
    """Where the fp32 main params, Adam moments and step came from: `checkpoint` (read from it), `reset` (the
    checkpoint holds weights only: main params from the weights, moments zero, step 0), `kept` (weights only, and
    the caller asked to keep the actor's own moments and step)."""
    source: Literal["native", "megatron"] = "native"
    """The format read: Tidal's run-checkpoint shards, or megatron-core dist_checkpointing."""


@runtime_checkable
class ActorBackend(Protocol):
    """One world rank's actor. See the module doc for the collective rule."""

    name: str
    build: str
    """What this rank built, for the run's record (the backend, and for megatron its layer spec and why)."""
    groups: GroupCache

    @property
    def layout(self) -> Layout: ...

    @property
    def member(self) -> bool: ...

    @property
    def coord(self) -> tuple[int, int] | None: ...

    @property
    def model(self) -> PolicyModel | None: ...

    def inventory(self) -> tuple[ParamSpec, ...]: ...

    def train_iter(self, source: MicrobatchSource, loss_fn: Callable[[Any, Any, int], torch.Tensor],
                   num_tokens_in_iter: int) -> IterReport | None: ...

    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None, *, local: bool = False,
                old_layout: Layout | None = None, prepared: Any = None) -> ReshardReport: ...

    def program_inputs(self) -> ProgramInputs | None: ...

    def sync_layout(self, layout: Layout | None) -> None: ...

    def export_weights(self) -> ExportedWeights | None: ...

    def gather_replica(self) -> dict[str, torch.Tensor] | None: ...

    def offload(self, *, optimizer: bool, grad: bool, weight: bool) -> int: ...

    def onload(self) -> int: ...

    def held_bytes(self) -> int: ...

    def resident_bytes(self) -> int: ...

    def save_checkpoint(self, tmp: str | Path, meta: CheckpointMeta) -> ShardRecord | None: ...

    def load_checkpoint(self, gen: str | Path, layout: Layout, ranks: tuple[int, ...] | None = None
                        ) -> CheckpointLoad: ...

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path: ...

    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> CheckpointLoad: ...


BackendFactory = Callable[..., ActorBackend]
_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register a backend under `name`; a second registration of a name is refused."""
    if name in _REGISTRY:
        raise ValueError(f"actor backend {name!r} is already registered ({_REGISTRY[name]!r})")
    _REGISTRY[name] = factory


def backend_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_REGISTRY))


def backend_available(name: str) -> str | None:
    """None when backend `name` can be built here, else the install command its missing package needs (a
    find_spec, no import: cheap enough for a config check)."""
    need = BACKEND_NEEDS.get(name)
    if need is None:
        return None
    module, install = need
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
        return install
    return None


def make_backend(name: str, *args: Any, **kwargs: Any) -> ActorBackend:
    """Build backend `name` with the factory's arguments (native: those of `ActorShard`)."""
    _load_builtin()
    if name not in _REGISTRY:
        install = backend_available(name)
        if install is not None:
            raise ConfigError("actor.backend", name, f"needs {BACKEND_NEEDS[name][0]}, which is not importable here",
                              f"{install} (or actor.backend: native)")
        raise ConfigError("actor.backend", name, "is not a registered actor backend",
                          f"use one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](*args, **kwargs)


def _load_builtin() -> None:
    # the native backend registers itself on import; importing it here keeps `protocol` free of engine imports

    import tidal.engine.backends.native
    if "megatron" not in _REGISTRY and backend_available("megatron") is None:
        import tidal.engine.backends.megatron_backend  # noqa: F401  (registers "megatron")


__all__ = ["ActorBackend", "PolicyModel", "ProgramInputs", "CheckpointLoad", "BackendFactory", "BACKEND_NEEDS",
           "register_backend", "backend_names", "backend_available", "make_backend"]
