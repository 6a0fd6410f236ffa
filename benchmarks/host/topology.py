"""Which cores of a machine can hold one CPU virtual device each without slowing each other down.

    python benchmarks/host/topology.py --json topology.json [--sets "8|8,9|8-15|0-15:2"]

A device that trains runs dense fp32 matmuls; two such processes on SMT siblings of one physical core share its
vector units and each runs at roughly half speed, while a decode loop (mostly interpreter work) hardly notices its
sibling. So the busy-neighbour probe of `benchmarks/share.py` (the e2e model's forward, small) can miss what an
actor at dp 8 meets. Here K single-threaded children, each pinned to one core of a set, run the same matmul loop
for `--seconds` at once; each reports its rate, and the table gives the mean rate relative to one child alone.

The kernel's view of the topology (`/sys/devices/system/cpu/cpu*/topology/thread_siblings_list`) is printed too;
a sandbox may not show the host's real one, which is why the rates are measured rather than read.
Core sets: "8" (one core), "8,9", "8-15", "0-15:2" (every second core from 0 to 15).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import os, sys, time, torch
torch.set_num_threads(1)
os.sched_setaffinity(0, {{{core}}})
a, b = torch.randn(256, 256), torch.randn(256, 1536)
for _ in range(20):
    a @ b
start = {start}
while time.time() < start:
    time.sleep(0.001)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < {seconds}:
    a @ b
    n += 1
print(n / (time.perf_counter() - t0))
"""


def parse_set(text: str) -> list[int]:
    """"8-15:2" -> [8, 10, 12, 14]; "8,9" -> [8, 9]; "8" -> [8]."""
    body, _, step = text.partition(":")
    out: list[int] = []
    for part in body.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out[::int(step)] if step else out


def rates(cores: list[int], seconds: float) -> list[float]:
    """Matmuls per second of one pinned child per core, all running in the same wall interval."""
    start = time.time() + 1.5 + 0.05 * len(cores)   # every child imports torch before the interval opens
    procs = [subprocess.Popen([sys.executable, "-c", CHILD.format(core=c, start=start, seconds=seconds)],
                              stdout=subprocess.PIPE, text=True) for c in cores]
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=120 + seconds)
        if p.returncode != 0:
            raise RuntimeError(f"probe child exited with {p.returncode}")
        out.append(float(text.strip().splitlines()[-1]))
    return out


def siblings() -> dict[int, str]:
    out = {}
    for c in range(os.cpu_count() or 1):
        f = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        out[c] = f.read_text().strip() if f.exists() else "?"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--sets", default="8|8,9|8,0|8-15|0-7|0-15:2|1-15:2|0-15",
                    help='"|"-separated core sets, each like "8-15", "8,9" or "0-15:2"')
    a = ap.parse_args(argv)
    res = {"name": "host_topology", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "cpu_count": os.cpu_count(), "thread_siblings": siblings(), "seconds": a.seconds, "sets": []}
    alone = None
    for text in a.sets.split("|"):
        cores = parse_set(text)
        r = rates(cores, a.seconds)
        alone = alone or r[0]
        row = {"set": text, "cores": cores, "rates": r, "mean_relative": sum(r) / len(r) / alone,
               "min_relative": min(r) / alone}
        res["sets"].append(row)
        print(f"{text:>10}: {len(cores):2d} busy, mean {row['mean_relative']:.2f}, min {row['min_relative']:.2f} "
              f"of one alone ({alone:.0f}/s)", flush=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res["thread_siblings"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
