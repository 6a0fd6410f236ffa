"""Workloads that look like RL runs, on model shapes and cluster sizes users have: `spec(workload, model, devices)`.

Response lengths (lognormal per sample, a shared per-prompt difficulty, clipped at the cap; `workload.LengthDist`):

| workload | median | spread (sample / prompt) | cap | prompt | samples per prompt | like |
|---|---|---|---|---|---|---|
| `gsm8k` | 250 | 0.45 / 0.35 | 1,024 | 120 | 8 | GRPO on GSM8K: short, few hit the cap |
| `math` | 700 | 0.7 / 0.5 | 4,096 | 150 | 8 | MATH-level problems |
| `longtail` | 3,000 | 0.8 / 0.6 | 16,384 | 300 | 16 | long reasoning (DAPO-style): a few % hit the cap |

Batch: `prompts_per_device` prompts per device a step (more for smaller models, so every model spends comparable
time per step), 4 optimizer iters a step. Placement before any search: RLinf's example split (1/4, 1/2, 1/4).
Costs: the measured H200 figures scaled to the shape (`model_costs.costs_for`) at the workload's mean context;
slots per rollout instance are the shape's (KV memory at long contexts).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.baselines import default_split, with_split
from scheduler.model_costs import ModelShape, costs_for, shape
from scheduler.state import PolicyParams
from scheduler.workload import EmpiricalLengths, LengthDist, SimSpec
from tidal.core.errors import TidalError


@dataclass(frozen=True)
class Workload:
    name: str
    lengths: LengthDist
    max_new_tokens: int
    prompt_tokens: int
    group_size: int
    prompts_per_device: dict[str, int]   #: by model shape
    n_minibatches: int = 4


WORKLOADS = {
    "gsm8k": Workload("gsm8k", LengthDist(median=250, sigma=0.45, group_sigma=0.35), 1024, 120, 8,
                      {"1.5b": 64, "7b": 16, "32b": 4}),
    "math": Workload("math", LengthDist(median=700, sigma=0.7, group_sigma=0.5), 4096, 150, 8,
                     {"1.5b": 32, "7b": 8, "32b": 2}),
    "longtail": Workload("longtail", LengthDist(median=3000, sigma=0.8, group_sigma=0.6), 16384, 300, 16,
                         {"1.5b": 8, "7b": 2, "32b": 1}),
}
MODELS = ("1.5b", "7b", "32b")
CLUSTERS = (8, 64, 512)


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise TidalError("workload", name, "unknown workload", f"use one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]


def mean_context(w: Workload, lengths: LengthDist | EmpiricalLengths) -> float:
    """The mean context of a running sequence: the prompt plus half its response, at the median response."""
    return w.prompt_tokens + lengths.median / 2


def fits(model: ModelShape, devices: int) -> str | None:
    """Why `model` has no disaggregated placement on `devices` devices (None: it has)."""
    need = model.min_actor_devices + model.rollout_tp + model.inference_tp
    if need > devices:
        return (f"{model.name}: the actor's state needs {model.min_actor_devices} devices, with a rollout and an "
                f"inference instance {need} > {devices}")
    return None


def spec(workload_name: str, model_name: str, devices: int,
         lengths: LengthDist | EmpiricalLengths | None = None) -> SimSpec:
    w, m = workload(workload_name), shape(model_name)
    why = fits(m, devices)
    if why:
        raise TidalError("devices", devices, why, "use a larger cluster or a smaller model")
    ld = lengths or w.lengths
    prompts = w.prompts_per_device[m.name] * devices
    params = PolicyParams(
        num_devices=devices, actor_devices=(), rollout_devices=(), inference_devices=(),
        actor_tp=m.actor_tp, rollout_tp=m.rollout_tp, inference_tp=m.inference_tp,
        rollout_batch_size=prompts, group_size=w.group_size, n_minibatches=w.n_minibatches,
        max_running_requests=m.slots, use_pre_process_policy=False, use_wait_before_last_iter_policy=False,
        pre_process_threshold=0.5, min_actor_devices=m.min_actor_devices)
    s = SimSpec(params=params, costs=costs_for(m, mean_context(w, ld)), lengths=ld,
                max_new_tokens=w.max_new_tokens, prompt_tokens=w.prompt_tokens,
                name=f"{w.name}-{m.name}-{devices}")
    return with_split(s, default_split(s))
