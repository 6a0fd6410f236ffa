"""A lower bound on the step time of any synchronous schedule that trains what the static run trains.

Every schedule Tidal may run keeps the learning of the static run: iter k trains the step's sequences
[k S / n, (k+1) S / n) in group-id order, on the policy that generated them (`tidal/pipeline/driver.py`). Whatever
the placement, the policy or the number of devices:

- group g cannot be generated before its longest sample alone has run: its prompt's prefill, then one decode step
  of a batch of one per token (`DecodeCost.step_time(1)`);
- iter k cannot start before every group of its mini-batch is generated and one of them scored, and iter k+1 not
  before iter k ends;
- an iter takes at least its time on every device of the cluster (the largest data-parallel actor);
- the step ends with the weight sync;
- the step's work fits the devices: every decoded token at least a full batch's share of a decode step, every
  prompt prefilled, every group scored, every iter trained at its cheapest in device-seconds (data parallel 1),
  spread over every device without a gap.

    bound = sync + max(the end of the chain  t_k = max(t_{k-1}, ready_k) + iter_k(all devices),
                       device-seconds of the work / devices)

`collocated / bound` is then the most any dynamic schedule could gain over collocated on that workload without
changing what each iter trains: with a long tail every mini-batch holds a sequence of it, every `ready_k` sits near
the rollout's end, and the chain is collocated's own training.
"""

from __future__ import annotations

import numpy as np

from scheduler.workload import SimSpec


def step_bound(spec: SimSpec, lengths: np.ndarray) -> float:
    """Seconds: the lower bound (module doc) for one step whose response lengths are `lengths` (groups x samples)."""
    p, c = spec.params, spec.costs
    prefill = c.decode.prefill_per_token_s * spec.prompt_tokens * p.group_size
    gen = prefill + lengths.max(axis=1) * c.decode.step_time(1)
    tokens = lengths.sum(axis=1) + p.group_size * spec.prompt_tokens
    gpi = p.groups_per_iter
    dp = p.num_devices // p.actor_tp
    t = work = 0.0
    for k in range(p.n_minibatches):
        ids = slice(k * gpi, (k + 1) * gpi)
        ready = float(gen[ids].max()) + min(c.inference.group_time(float(x), p.inference_tp) for x in tokens[ids])
        t = max(t, ready) + c.actor.iter_time(float(tokens[ids].sum()), p.actor_tp, dp, p.micro_batches)
        work += c.actor.iter_time(float(tokens[ids].sum()), p.actor_tp, 1, p.micro_batches) * p.actor_tp
    d = c.decode
    work += float(lengths.sum()) * (d.step_s / p.max_running_requests + d.per_seq_s) * p.rollout_tp
    work += d.prefill_per_token_s * spec.prompt_tokens * lengths.size * p.rollout_tp
    work += sum(c.inference.group_time(float(x), p.inference_tp) for x in tokens) * p.inference_tp
    return max(t, work / p.num_devices) + c.sync_time()
