"""Simulated workloads: `SimSpec` (cluster, placement, batch shape, length distribution, costs) and sampling.

Response lengths are long-tailed and correlated within a group (a hard prompt makes every sample long)::

    len[g, s] = clip(round(median * exp(group_sigma * z_g + sigma * z_gs)), 1, max_new_tokens)

with z standard normal from a seeded generator (one stream per step, so a step's lengths do not depend on
the policy). `kind: pareto` uses a Pareto(alpha) tail instead of the lognormal one, scaled to the median.

`rlinf_example(devices)` is RLinf's shipped 8-GPU example (1.5B model, 512 prompts x 16, 4 iters, actor TP 2;
actor 1/4, rollout 1/2, inference 1/4 of the devices), with prompts scaled by `prompts_per_device` when the
cluster grows. `SimSpec.from_config` reads a Tidal config; `devices=N` rescales the placement the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from scheduler.costs import CostModel, cpu_tiny, gpu_h200_1p5b
from scheduler.state import PolicyParams
from tidal.core.config import TidalConfig
from tidal.core.errors import TidalError


@dataclass(frozen=True)
class LengthDist:
    kind: Literal["lognormal", "pareto"] = "lognormal"
    median: float = 1024.0       #: median response length, tokens
    sigma: float = 0.8           #: per-sample log-spread (lognormal)
    group_sigma: float = 0.6     #: per-prompt log-spread shared by the group (difficulty)
    alpha: float = 1.6           #: Pareto tail index (pareto)

    def sample(self, rng: np.random.Generator, groups: int, group_size: int, max_new: int,
               step: int = 0) -> np.ndarray:
        """`groups` x `group_size` lengths from `rng` (one stream per step: `step` itself is not read)."""
        zg = rng.standard_normal((groups, 1)) * self.group_sigma
        if self.kind == "lognormal":
            x = self.median * np.exp(zg + rng.standard_normal((groups, group_size)) * self.sigma)
        else:  # Pareto with the given median: x_m * 2^(1/alpha) = median
            xm = self.median / 2 ** (1 / self.alpha)
            x = xm * np.exp(zg) * (1 + rng.pareto(self.alpha, (groups, group_size)))
        return np.clip(np.rint(x), 1, max_new).astype(np.int64)


class Lengths(Protocol):
    """Where a simulated step's response lengths come from: a distribution, a file's lengths resampled, or a run's
    own lengths replayed step by step."""

    @property
    def median(self) -> float: ...

    def sample(self, rng: np.random.Generator, groups: int, group_size: int, max_new: int,
               step: int = 0) -> np.ndarray: ...


@dataclass(frozen=True)
class RecordedLengths:
    """The response lengths a run generated, one step's at a time (`step`), for the simulator to replay."""

    steps: tuple[np.ndarray, ...]
    median: float

    def sample(self, rng: np.random.Generator, groups: int, group_size: int, max_new: int,
               step: int = 0) -> np.ndarray:
        x = self.steps[step % len(self.steps)]
        if x.shape != (groups, group_size):
            raise TidalError("steps.json", list(x.shape), f"does not match the config's {groups} x {group_size} groups",
                             "predict a run with the config it ran with")
        return np.clip(x, 1, max_new)


@dataclass(frozen=True)
class EmpiricalLengths:
    """Response lengths of a real run, resampled: whole groups drawn with replacement (a group keeps its
    difficulty), each sample of a group drawn from that group's lengths; flat lists are drawn i.i.d."""

    groups: tuple[tuple[int, ...], ...]
    source: str = "file"

    @property
    def median(self) -> float:
        return float(np.median(np.concatenate([np.asarray(g, dtype=np.float64) for g in self.groups])))

    def sample(self, rng: np.random.Generator, groups: int, group_size: int, max_new: int,
               step: int = 0) -> np.ndarray:
        if len(self.groups) == 1:   # a flat list: i.i.d. draws
            pool = np.asarray(self.groups[0], dtype=np.int64)
            x = pool[rng.integers(0, pool.size, (groups, group_size))]
        else:
            pick = rng.integers(0, len(self.groups), groups)
            x = np.empty((groups, group_size), dtype=np.int64)
            for row, g in enumerate(pick.tolist()):
                pool = np.asarray(self.groups[g], dtype=np.int64)
                x[row] = pool[rng.integers(0, pool.size, group_size)]
        return np.clip(x, 1, max_new)

    @classmethod
    def from_file(cls, path: str | Path) -> EmpiricalLengths:
        """A JSON file: a list of response lengths, or a list of groups (lists of lengths), or an object with
        one of those under `lengths` or `groups`; or a finished run's folder, whose `steps.json` holds every
        group's lengths of every step."""
        field_ = "--lengths"
        if Path(path).is_dir():
            path = Path(path) / "steps.json"
            try:
                steps = json.loads(path.read_text())
                groups = [g for st in steps for g in st["response_lengths"]]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise TidalError(field_, str(path.parent), f"is not a finished run's folder ({e})",
                                 "give a run folder with steps.json, or a JSON file of lengths") from None
            return cls._of(groups, str(path.parent), field_)
        try:
            data: Any = json.loads(Path(path).read_text())
        except OSError as e:
            raise TidalError(field_, str(path), f"cannot be read ({e.strerror})",
                             "give a JSON file of lengths") from None
        except json.JSONDecodeError as e:
            raise TidalError(field_, str(path), f"is not JSON ({e.msg}, line {e.lineno})",
                             "write a JSON list of response lengths, or a list of groups of them") from None
        if isinstance(data, dict):
            data = data.get("groups", data.get("lengths"))
        return cls._of(data, str(path), field_)

    @classmethod
    def _of(cls, data: object, path: str, field_: str) -> EmpiricalLengths:
        if not isinstance(data, list) or not data:
            raise TidalError(field_, str(path), "holds no lengths",
                             'write [312, 4096, ...] or [[312, 290], [4096, 8000], ...] or {"groups": [...]}')
        rows = data if all(isinstance(g, list) for g in data) else [data]
        groups = []
        for k, g in enumerate(rows):
            if not g or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in g):
                raise TidalError(field_, str(path), f"entry {k} is not a non-empty list of integer lengths >= 0",
                                 "every length is a number of tokens")
            groups.append(tuple(g))
        return cls(tuple(groups), path)


@dataclass(frozen=True)
class SimSpec:
    """Everything a simulation needs besides the policy, the step count and the seed."""

    params: PolicyParams
    costs: CostModel
    lengths: Lengths = field(default_factory=LengthDist)
    max_new_tokens: int = 8192
    prompt_tokens: int = 256
    name: str = "custom"
    #: the real driver asks the policy again at most every this many seconds while the actor waits at a boundary
    #: (the reconciler's `min_interval_s`, 0.2 s); None: only on events (an iter done, a drain, scoring done, ...)
    poll_s: float | None = None

    @property
    def num_devices(self) -> int:
        return self.params.num_devices

    def scaled(self, devices: int) -> SimSpec:
        """The same workload shape on `devices` devices: actor 1/4, rollout 1/2, inference 1/4."""
        return replace(self, params=scale_params(self.params, devices, self.params.rollout_batch_size))

    @classmethod
    def from_config(cls, cfg: TidalConfig, devices: int | None = None) -> SimSpec:
        """Costs: the CPU preset when `cluster.device` is cpu, else the GPU preset. Lengths: median at
        max_new_tokens / 8, the default spreads."""
        params = PolicyParams.from_config(cfg)
        if devices is not None:
            params = scale_params(params, devices, params.rollout_batch_size)
        costs = cpu_tiny() if cfg.cluster.device == "cpu" else gpu_h200_1p5b()
        mnt = cfg.rollout.max_new_tokens
        prompt = max(1, cfg.model.max_seq_len - mnt) // 2 or 1
        return cls(params=params, costs=costs, lengths=LengthDist(median=max(1.0, mnt / 8)),
                   max_new_tokens=mnt, prompt_tokens=prompt, name=cfg.run.name)


def scale_params(p: PolicyParams, devices: int, prompts: int) -> PolicyParams:
    """RLinf example placement on `devices`: actor [0, N/4), rollout [N/4, 3N/4), inference [3N/4, N)."""
    if devices < 4 or devices % 4:
        raise TidalError("--devices", devices, "must be a multiple of 4 (actor 1/4, rollout 1/2, inference 1/4)",
                         "e.g. --devices 8, 64 or 1024")
    q = devices // 4
    for name, n, tp in (("actor", q, p.actor_tp), ("rollout", 2 * q, p.rollout_tp), ("inference", q, p.inference_tp)):
        if n % tp:
            raise TidalError("--devices", devices, f"gives {name} {n} devices, not a multiple of its TP {tp}",
                             f"use a device count with N/4 divisible by {tp}")
    return replace(p, num_devices=devices, actor_devices=tuple(range(q)), rollout_devices=tuple(range(q, 3 * q)),
                   inference_devices=tuple(range(3 * q, devices)), rollout_batch_size=prompts)


def rlinf_example(devices: int = 8, prompts_per_device: int = 64, max_running_requests: int = 512,
                  costs: CostModel | None = None) -> SimSpec:
    """RLinf's 8-GPU example workload (1.5B, 512 prompts x 16, 4 iters, actor TP 2), scaled to `devices`;
    `costs` default: the derived GPU preset (`gpu_h200_1p5b`)."""
    base = PolicyParams(
        num_devices=8, actor_devices=(0, 1), rollout_devices=(2, 3, 4, 5), inference_devices=(6, 7),
        actor_tp=2, rollout_tp=1, inference_tp=1, rollout_batch_size=512, group_size=16, n_minibatches=4,
        max_running_requests=max_running_requests, use_pre_process_policy=False,
        use_wait_before_last_iter_policy=False, pre_process_threshold=0.5)
    params = base if devices == 8 else scale_params(base, devices, prompts_per_device * devices)
    return SimSpec(params=params, costs=costs or gpu_h200_1p5b(), name=f"rlinf-example-{devices}")
