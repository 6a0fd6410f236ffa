"""A -> B -> A bit-exactness of the elastic actor across processes, for every world-2 layout pair, in one JSON.

    python benchmarks/reshard_check_nccl.py --json out.json                  # NCCL, one process per GPU (2 GPUs)
    python benchmarks/reshard_check_nccl.py --backend gloo --json out.json   # the same on CPU processes

Each pair runs the `tidal reshard-check` body (tidal/cli/reshard_check.py): a small fp32 model trained one step at A,
resharded to B, every tensor of B gathered and compared bit for bit with A (params, fp32 master, both Adam moments,
step, data cursor, the RNG rule), then resharded back and every rank's own buffers compared with those before.
Exit 0 when every pair passes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

from tidal.cli.reshard_check import _check_body, run_world

PAIRS = [("tp=1,dp=1", "tp=1,dp=2"), ("tp=1,dp=2", "tp=1,dp=1"), ("tp=2,dp=1", "tp=1,dp=1"),
         ("tp=1,dp=1", "tp=2,dp=1"), ("tp=1,dp=1", "tp=1,dp=1,devices=1"), ("tp=1,dp=2", "tp=2,dp=1")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path")
    ns = p.parse_args(argv)
    if ns.backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"error: --backend nccl needs 2 GPUs, this machine has {torch.cuda.device_count()}; "
              f"use --backend gloo", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for a, b in PAIRS:
        res = run_world(2, ns.backend, _check_body, a, b, ns.backend, ns.seed)
        mismatch = next((r["mismatch"] for r in res if r["mismatch"]), None)
        rows.append({"from": a, "to": b, "ok": mismatch is None, "mismatch": mismatch,
                     "num_tensors": res[0]["num_tensors"], "bytes_moved": res[0]["bytes_moved"],
                     "seconds": max(r["seconds"] for r in res)})
        print(f"{a:>22} -> {b:<24} {'ok' if mismatch is None else 'FAILED: ' + mismatch}", flush=True)
    out = {"name": "reshard_check", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu, torch {torch.__version__}"
                      + (f", 2 x {torch.cuda.get_device_name(0)}" if ns.backend == "nccl" else ""),
           "backend": ns.backend, "world": 2, "ok": all(r["ok"] for r in rows), "pairs": rows}
    print(f"{sum(r['ok'] for r in rows)}/{len(rows)} pairs bit-exact A -> B -> A on {ns.backend}")
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
