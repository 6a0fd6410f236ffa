"""Static placements whose components share devices (collocated, hybrid): who waits for whom on a shared device,
and what is handed over there. Pure: the driver (`tidal.pipeline.driver`) asks it, the workers act.

Placement keys are disjoint sets, so two components either share all their devices or none. On a shared set
the components run in turn, each phase on every device of the set::

    actor + rollout (+ inference)   generate (actor state offloaded: actor.offload_*) -> [score] -> hand-over
                                    (the engines there are released, the actor's state comes back) -> train
    rollout + inference             generate -> the engines' KV caches freed -> score (the rollout engine's model)
    actor + inference               score and train interleave (one call at a time per device), as groups arrive

A component on devices of its own streams as in a disaggregated run (hybrid: rollout apart keeps generating the
next groups while the shared devices score and train). At the step end the actor's ranks gather whole replicas
on their devices (`ActorShard.gather_replica`), and the engines sharing those devices load them in place.

What is computed never depends on the sharing: iter k trains on the same sequences in group-id order, every
sample's tokens depend only on its seeds, scoring is per group. A shared run therefore ends with the parameters
of the disaggregated static run on the same seeds and data, bit for bit (CPU, tests/test_collocated.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tidal.core.config import ActorConfig
from tidal.core.placement import Mode, Placement, format_ids


@dataclass(frozen=True)
class Sharing:
    """Which components of a static placement share devices, and the hand-over keys that apply."""

    mode: Mode
    actor_rollout: bool        #: the actor trains only once its devices have generated every group
    #: scoring there waits until generation is done (the KV caches are freed first) and reads the rollout
    #: engine's model (one copy of the weights per device)
    rollout_inference: bool
    actor_inference: bool      #: scoring and training interleave on those devices
    offload_optimizer: bool = False
    offload_grad: bool = False
    offload_weight: bool = False

    @staticmethod
    def of(placement: Placement, actor_cfg: ActorConfig | None = None) -> Sharing:
        a, r, i = set(placement.actor), set(placement.rollout), set(placement.inference)
        ar = bool(a & r)
        return Sharing(placement.mode, ar, bool(r & i), bool(a & i),
                       offload_optimizer=ar and actor_cfg is not None and actor_cfg.offload_optimizer,
                       offload_grad=ar and actor_cfg is not None and actor_cfg.offload_grad,
                       offload_weight=ar and actor_cfg is not None and actor_cfg.offload_weight)

    @property
    def any(self) -> bool:
        return self.actor_rollout or self.rollout_inference or self.actor_inference

    @property
    def offloads(self) -> dict[str, bool]:
        return {"optimizer": self.offload_optimizer, "grad": self.offload_grad, "weight": self.offload_weight}

    def train_waits_for_rollout(self) -> bool:
        """The actor's first iter of a step waits until every group is generated (its devices generate)."""
        return self.actor_rollout

    def train_waits_for_scoring(self) -> bool:
        """... and until every group is scored (its devices also score): both engines leave before it trains."""
        return self.actor_rollout and self.actor_inference

    def score_waits_for_rollout(self) -> bool:
        return self.rollout_inference

    def plan(self, placement: Placement) -> list[str]:
        """One line per phase of a step, for `tidal validate`."""
        p, ids = placement, format_ids
        if not self.any:
            return [f"actor on {ids(p.actor)}, rollout on {ids(p.rollout)}, inference on {ids(p.inference)}: "
                    "each on its own devices, streaming"]
        off = [k for k, v in self.offloads.items() if v]
        held = f"actor's {' + '.join(off)} in host memory" if off else "actor state stays on the devices: " \
            "actor.offload_* off"
        lines = []
        if self.actor_rollout:
            lines.append(f"1. generate: rollout on {ids(p.rollout)} ({held})")
        elif self.rollout_inference:
            lines.append(f"1. generate: rollout on {ids(p.rollout)}, every group of the step")
        else:
            lines.append(f"1. generate: rollout on {ids(p.rollout)}, streaming groups to the others")
        if self.rollout_inference:
            lines.append(f"2. score: inference on {ids(p.inference)} once generation is done (KV caches freed; "
                         "the rollout engine's model scores)")
        elif self.actor_inference:
            lines.append(f"2. score: inference on {ids(p.inference)} as groups arrive, in turn with training")
        else:
            lines.append(f"2. score: inference on {ids(p.inference)} as groups arrive")
        if self.actor_rollout:
            wait = "every group is scored" if self.actor_inference else "every group is generated"
            gone = "the engines there released" if self.actor_inference else "the rollout engines there released"
            lines.append(f"3. train: actor on {ids(p.actor)} once {wait} ({gone}, the actor's state back)")
        else:
            lines.append(f"3. train: actor on {ids(p.actor)} as mini-batches are scored")
        engines = set(p.rollout) | set(p.inference)
        shared, apart = sorted(set(p.actor) & engines), sorted(engines - set(p.actor))
        sync = [f"a local copy on {ids(shared)} (the actor's replicas gathered on its devices)"] if shared else []
        sync += [f"through the object store to {ids(apart)}"] if apart else []
        lines.append(f"4. weight sync: {'; '.join(sync)}")
        return lines
