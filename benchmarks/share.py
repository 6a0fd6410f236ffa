"""Busy-neighbour check of CPU virtual devices: does a capped device slow down when the others work?

    python benchmarks/share.py --json benchmarks/results/share/<date>_<commit7>_<machine>.json

A GPU's speed does not depend on its neighbours. A CPU virtual device capped at a share of the machine
(`cluster.cpu_compute_share`) is faithful only if its speed is also independent of how many other devices are
busy, or a dynamic scheduler (whose point is to make idle devices busy) is charged for the machine rather than
for its decisions. A share caps CPU *time*; whether CPU time is work depends on where it runs. On this
project's 2-vCPU VM the two vCPUs behave like hyperthreads of one host core: two busy vCPUs do about the work
of one (docs/e2e.md).

Each setup is `CORES:SHARE` (CORES `all`, or ids like `1` / `2-7`: the cores the devices are pinned to, the
driver and Ray then run on the others; SHARE: `cluster.cpu_compute_share`, a fraction of those cores). For each,
8 capped workers start, and device 0 plus k-1 others run the same forward loop
(`tidal.workers.probes:forward_rate`) for `--seconds`; reps interleave the k values so drift hits all alike.
Printed: each device's rate with k busy relative to one device busy alone (1.00 = independent, as on a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

PROBE = "tidal.workers.probes:forward_rate"


def rates(group, busy: list[int], seconds: float) -> list[float]:
    return list(group.gather(group.submit_all(PROBE, device_ids=busy, seconds=seconds), timeout=120 + seconds))


def measure(share: float | None, cores: tuple[int, ...] | None, devices: int, busy_counts: list[int],
            seconds: float, reps: int) -> dict[int, float]:
    from tidal.workers.runtime import WorkerGroup

    group = WorkerGroup.start(list(range(devices)), "cpu", compute_share=share, cpu_cores=cores)
    try:
        rates(group, list(range(devices)), 1.0)  # build the model everywhere, warm the allocator
        per_k: dict[int, list[float]] = {k: [] for k in busy_counts}
        for _ in range(reps):
            for k in busy_counts:
                per_k[k].append(statistics.mean(rates(group, list(range(k)), seconds)))
        return {k: statistics.median(v) for k, v in per_k.items()}
    finally:
        group.shutdown()


def parse_setup(text: str) -> tuple[tuple[int, ...] | None, float]:
    from tidal.core.placement import parse_device_ids

    cores_s, _, share_s = text.partition(":")
    cores = None if cores_s == "all" else parse_device_ids(cores_s, "--setups cores")
    try:
        share = float(share_s)
    except ValueError:
        raise SystemExit(f"--setups: {text!r} is not CORES:SHARE (e.g. all:0.125 or 1:0.125)") from None
    return cores, share


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    n = os.cpu_count() or 1
    default = "all:0.125,all:0.1" + (f",{'1' if n == 2 else f'1-{n - 1}'}:0.125" if n > 1 else "")
    ap.add_argument("--setups", default=default, help="CORES:SHARE,... (default: %(default)s)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=3.0, help="wall time per measurement")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    setups = [parse_setup(s) for s in a.setups.split(",")]
    pinned = set().union(*[set(c) for c, _ in setups if c])
    if pinned and len(pinned) < n:  # the driver (and the Ray processes it starts) off the devices' cores
        os.sched_setaffinity(0, set(range(n)) - pinned)
    busy_counts = sorted({1, 2, a.devices // 2, a.devices})
    rows = []
    for cores, share in setups:
        r = measure(share, cores, a.devices, busy_counts, a.seconds, a.reps)
        row = {"cores": list(cores) if cores else "all", "share": share, "rate_alone": r[1],
               "rate_by_busy": {str(k): v for k, v in r.items()},
               "relative_by_busy": {str(k): v / r[1] for k, v in r.items()}}
        rows.append(row)
        rel = "  ".join(f"{k} busy {v / r[1]:.2f}" for k, v in r.items())
        where = "any core" if cores is None else f"cores {','.join(map(str, cores))}"
        print(f"{where:>10} share {share:.3f}: alone {r[1]:5.1f} fwd/s | {rel}", flush=True)
    res = {"name": "share_busy_neighbours", "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "machine": {"cpu_count": n, "platform": platform.platform(), "python": sys.version.split()[0]},
           "devices": a.devices, "seconds": a.seconds, "reps": a.reps, "setups": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
