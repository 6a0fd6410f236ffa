"""The actor backend protocol: what the pipeline asks of the training engine on one world rank.

The pipeline (workers, scheduler) drives an actor through five verbs and never reaches inside it::

    train_iter(source, loss_fn, num_tokens)   one optimizer step over the iter's micro-batch queue
    inventory()                               the state inventory the reshard planner plans from (ParamSpecs:
                                              name, global shape, TP dim; ZeRO-1 optimizer ranges follow)
    reshard(new_layout)                       plan / execute / commit to another (tp, dp, devices)
    export_weights()                          TP-local weights for rollout weight sync
    save_megatron(dir) / load_megatron(dir)   weights in megatron-core dist_checkpointing format, any layout

Every verb is collective over the world like `ActorShard`'s: every world rank calls it at the same point; ranks
outside the layout take part in group creation and votes and return None where a value is returned.

A backend is picked by name (`actor.backend`), the one place users plug in, so there is a registry and it refuses
duplicates. Registered here: "native" (tidal/engine/backends/native.py, over `ActorShard`) and, when megatron-core is
importable, "megatron" (tidal/engine/backends/megatron_backend.py: GPTModel + megatron-core DDP + DistributedOptimizer).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tidal.core.errors import ConfigError
from tidal.engine.layout import Layout, ParamSpec


@runtime_checkable
class ActorBackend(Protocol):
    """One world rank's actor. See the module doc for the collective rule."""

    name: str

    @property
    def layout(self) -> Layout: ...

    def inventory(self) -> tuple[ParamSpec, ...]: ...

    def train_iter(self, source: Any, loss_fn: Callable, num_tokens_in_iter: int) -> Any: ...

    def reshard(self, new_layout: Layout, fault: Callable[[str], None] | None = None) -> Any: ...

    def export_weights(self) -> Any: ...

    def save_megatron(self, ckpt_dir: str | Path, padded_vocab: int | None = None) -> Path: ...

    def load_megatron(self, ckpt_dir: str | Path, reset_optimizer: bool = True) -> None: ...


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


def make_backend(name: str, *args: Any, **kwargs: Any) -> ActorBackend:
    """Build backend `name` with the factory's arguments (native: those of `ActorShard`)."""
    _load_builtin()
    if name not in _REGISTRY:
        raise ConfigError("actor.backend", name, "is not a registered actor backend",
                          f"use one of {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](*args, **kwargs)


def _load_builtin() -> None:
    # the native backend registers itself on import; importing it here keeps `protocol` free of engine imports

    import tidal.engine.backends.native
    if "megatron" not in _REGISTRY and importlib.util.find_spec("megatron") is not None \
            and importlib.util.find_spec("megatron.core") is not None:
        import tidal.engine.backends.megatron_backend  # noqa: F401  (registers "megatron")


__all__ = ["ActorBackend", "BackendFactory", "register_backend", "backend_names", "make_backend"]
