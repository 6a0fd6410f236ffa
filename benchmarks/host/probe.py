"""What a machine offers CPU virtual devices: cores, the cap backend `ComputeShare` picks, whether a cap holds.

    python benchmarks/host/probe.py --json probe.json

One busy child process runs alone, capped at each of a few core counts for `--seconds`; the achieved rate is
its CPU time per wall second (from /proc/PID/stat, which every kernel and gVisor keep). A cap that holds reads
close to its target; a backend that accepts the quota without enforcing it reads ~1.0 for every target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tidal.workers.compute_share import ComputeShare, cpu_time_s, stat_cpu_time_s


def achieved(cores: float, seconds: float, backend: str) -> dict:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        cap = ComputeShare.apply(child.pid, cores=cores, backend=backend)
        c0, t0, s0 = stat_cpu_time_s(child.pid), time.monotonic(), cpu_time_s(child.pid)
        time.sleep(seconds)
        c1, t1, s1 = stat_cpu_time_s(child.pid), time.monotonic(), cpu_time_s(child.pid)
        cap.release()
        return {"target_cores": cores, "backend": cap.backend, "achieved_cores": (c1 - c0) / (t1 - t0),
                "cpu_time_s_rate": (s1 - s0) / (t1 - t0)}
    finally:
        child.kill()
        child.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--cores", default="0.125,0.25,0.5")
    a = ap.parse_args(argv)
    schedstat = Path("/proc/self/schedstat").read_text().split() if Path("/proc/self/schedstat").exists() else []
    res = {"cpu_count": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
           "schedstat_self": schedstat, "cgroup_controllers": _read("/sys/fs/cgroup/cgroup.controllers"),
           "caps": []}
    for backend in ("auto", "duty"):
        for c in (float(x) for x in a.cores.split(",")):
            try:
                res["caps"].append(achieved(c, a.seconds, backend))
            except Exception as e:  # noqa: BLE001 - a probe reports what failed and goes on
                res["caps"].append({"target_cores": c, "backend": backend, "error": f"{type(e).__name__}: {e}"})
            print(res["caps"][-1], flush=True)
    Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "caps"}))
    return 0


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
