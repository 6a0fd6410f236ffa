"""Policy registry: `decide(state, signals, now) -> list[Action]`, pure, by name.

- `static`: never moves a device (the baseline every dynamic policy must beat);
- `rlinf`: RLinf's dynamic scheduler, flaws included (`policy_rlinf.py`);
- `tidal`: the cost-model policy, the default (`policy_tidal.py`).

The same functions drive the simulator and, through the reconciler, real workers.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler import policy_rlinf, policy_tidal
from scheduler.actions import Action
from scheduler.signals import Signals
from scheduler.state import SchedState
from tidal.core.errors import TidalError

Policy = Callable[[SchedState, Signals, float], list[Action]]


def decide_static(state: SchedState, sig: Signals, now: float) -> list[Action]:
    """Every component keeps its placement for the whole run."""
    return []


POLICIES: dict[str, Policy] = {
    "static": decide_static,
    "rlinf": policy_rlinf.decide,
    "tidal": policy_tidal.decide,
}


def get_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise TidalError("scheduler.policy", name, "unknown policy", f"use one of {sorted(POLICIES)}")
    return POLICIES[name]
