"""`tidal compare`: MLflow runs side by side, or grouped by policy or by sweep, to compare policies.

    tidal compare 3f2a9c... 81bd07...                     # runs by id
    tidal compare --experiment tidal --group-by policy     # one column per policy (tag tidal.policy)
    tidal compare --sweep policy-flags-sim                 # a sweep's trials (tag tidal.sweep = the study)

Each metric shows its final value (the latest step) with its mean and min..max over the logged steps: a final
value alone can mislead (one slow last step hides a fast run). Grouped, a column averages its runs' final values
and takes the mean, min and max over every step of every run. The same rows from notebooks: `select_runs`,
`compare_runs`, `compare_groups` (lists of `CompareRow`). mlflow itself is imported by `tidal.tracking` only
(`store_client`, `find_run`).
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from tidal.core.config import TrackingConfig
from tidal.core.errors import TidalError
from tidal.tracking import find_run, store_client

#: `--group-by` choice -> the run tag it groups by (set by `RunTracking.open` and `tidal sweep`)
GROUP_TAGS = {"policy": "tidal.policy", "sweep": "tidal.sweep"}
#: run tags shown in the "run" section where a run has them: (row name, tag)
RUN_TAGS = (("policy", "tidal.policy"), ("sweep", "tidal.sweep"), ("trial", "tidal.trial"))
NO_GROUP = "(none)"
MAX_RUNS = 1000


@dataclass(frozen=True)
class CompareRow:
    """One row of `tidal compare`: section is "run", "param" or "metric"; one value per column (a run, or a group
    of runs; None: absent)."""

    section: str
    key: str
    values: tuple[object, ...]
    stats: tuple[tuple[float, float, float] | None, ...] = ()
    """Metrics: per column (mean, min, max) over every logged step (of every run of a group), None where a single
    value was logged or none: a final value alone can mislead (one slow last step hides a fast run)."""


def select_runs(uri: str, run_ids: list[str] | tuple[str, ...] = (), experiment: str | None = None,
                sweep: str | None = None) -> list[str]:
    """Run ids to compare: `run_ids` as given, else the runs of `experiment` (every experiment when None) that
    carry the tag `tidal.sweep` = `sweep` (any run when None), oldest first."""
    if run_ids:
        return list(run_ids)
    if experiment is None and sweep is None:
        raise TidalError("RUN", "", "no runs chosen", "pass MLflow run ids, or --experiment NAME and/or --sweep STUDY")
    client = store_client(uri)
    if experiment is not None:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise TidalError("--experiment", experiment, f"no such experiment in {uri}",
                             f"use one of {names}" if names else "log a run first (tidal train)")
        exp_ids = [exp.experiment_id]
    else:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
    if sweep is not None and "'" in sweep:
        raise TidalError("--sweep", sweep, "holds a quote, which MLflow's filter cannot match",
                         "pass the study name tidal sweep printed")
    sweep_filter = f"tags.`tidal.sweep` = '{sweep}'" if sweep is not None else ""
    runs = client.search_runs(exp_ids, sweep_filter, max_results=MAX_RUNS, order_by=["attributes.start_time ASC"])
    if not runs:
        raise TidalError("--sweep" if sweep is not None else "--experiment", sweep if sweep is not None
                         else experiment, f"matches no run in {uri}", "check the name (MLflow UI, or tidal sweep's "
                         "output: its study name)")
    return [r.info.run_id for r in runs]


def _get_runs(client: Any, run_ids: list[str], uri: str) -> list[Any]:
    if not run_ids:
        raise TidalError("RUN", "", "no run ids given", "pass one or more MLflow run ids")
    runs = []
    for rid in run_ids:
        run = find_run(client, rid)
        if run is None:
            raise TidalError("RUN", rid, f"no such run in {uri}",
                             "copy the run id from the MLflow UI or `tidal train`'s output")
        runs.append(run)
    return runs


def _history(client: Any, run: Any, key: str) -> list[float]:
    return [m.value for m in client.get_metric_history(run.info.run_id, key)] if key in run.data.metrics else []


def _stats(values: list[float]) -> tuple[float, float, float] | None:
    return (sum(values) / len(values), min(values), max(values)) if len(values) > 1 else None


def _duration_s(r: Any) -> float | None:
    if r.info.end_time is None or r.info.start_time is None:
        return None
    return round((r.info.end_time - r.info.start_time) / 1000.0, 1)


def compare_runs(run_ids: list[str], uri: str, all_params: bool = False) -> list[CompareRow]:
    """Rows for a side-by-side table: run info and tags (policy, sweep, trial), params that differ (all with
    `all_params` or one run), and each metric's final value (MLflow's latest by step) with its stats."""
    client = store_client(uri)
    runs = _get_runs(client, run_ids, uri)
    rows = [CompareRow("run", "name", tuple(r.info.run_name for r in runs)),
            CompareRow("run", "status", tuple(r.info.status for r in runs))]
    for key, tag in (("parent", "mlflow.parentRunId"), *RUN_TAGS):
        vals = tuple(r.data.tags.get(tag) for r in runs)
        if any(vals):
            rows.append(CompareRow("run", key, vals))
    rows.append(CompareRow("run", "duration_s", tuple(_duration_s(r) for r in runs)))
    for key in sorted(set().union(*(r.data.params for r in runs))):
        vals = tuple(r.data.params.get(key) for r in runs)
        if all_params or len(runs) == 1 or len(set(vals)) > 1:
            rows.append(CompareRow("param", key, vals))
    for key in sorted(set().union(*(r.data.metrics for r in runs))):
        stats = tuple(_stats(_history(client, r, key)) for r in runs)
        rows.append(CompareRow("metric", key, tuple(r.data.metrics.get(key) for r in runs), stats))
    return rows


def compare_groups(run_ids: list[str], uri: str, by: str) -> tuple[list[str], list[CompareRow]]:
    """Runs grouped by `by` (GROUP_TAGS: policy, sweep); returns (group names, rows). Per group: its number of
    runs; each param that differs between groups (a group whose runs differ shows how many values they hold);
    each metric's final value averaged over the group's runs, with the mean, min and max over every step of
    every run of the group. Runs without the tag form the group NO_GROUP."""
    if by not in GROUP_TAGS:
        raise TidalError("--group-by", by, "is not a grouping", f"use one of {', '.join(GROUP_TAGS)}")
    client = store_client(uri)
    groups: dict[str, list[Any]] = {}
    for r in _get_runs(client, run_ids, uri):
        groups.setdefault(r.data.tags.get(GROUP_TAGS[by]) or NO_GROUP, []).append(r)
    names = sorted(groups, key=lambda g: (g == NO_GROUP, g))
    members = [groups[g] for g in names]
    rows = [CompareRow("run", "runs", tuple(len(m) for m in members)),
            CompareRow("run", "finished", tuple(sum(r.info.status == "FINISHED" for r in m) for m in members))]
    for key in sorted(set().union(*(r.data.params for m in members for r in m))):
        per = [{r.data.params.get(key) for r in m} for m in members]
        vals = tuple(next(iter(v)) if len(v) == 1 else f"<{len(v)} values>" for v in per)
        if len(set(vals)) > 1:
            rows.append(CompareRow("param", key, vals))
    for key in sorted(set().union(*(r.data.metrics for m in members for r in m))):
        finals, stats = [], []
        for m in members:
            have = [r for r in m if key in r.data.metrics]
            finals.append(sum(r.data.metrics[key] for r in have) / len(have) if have else None)
            stats.append(_stats([v for r in have for v in _history(client, r, key)]))
        rows.append(CompareRow("metric", key, tuple(finals), tuple(stats)))
    return names, rows


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.6g}"
    return str(v)


def print_comparison(columns: list[str], rows: list[CompareRow], console: Any = None, title: str = "runs compared",
                     ) -> None:
    """`columns`: run ids (shown by their first 8 characters) or group names."""
    console = console or Console()
    table = Table(title=title, show_lines=False)
    table.add_column("", style="dim")
    table.add_column("key")
    for col in columns:
        table.add_column(col[:8] if len(col) == 32 and col.isalnum() else col, justify="right")
    section = None
    for row in rows:
        if section is not None and row.section != section:
            table.add_section()
        section = row.section
        cells = [_fmt(v) for v in row.values]
        distinct = len(set(cells)) > 1
        cells = [c if not st else f"{c}  (mean {_fmt(st[0])}, {_fmt(st[1])}..{_fmt(st[2])})"
                 for c, st in zip(cells, row.stats or (None,) * len(cells))]
        table.add_row(row.section, row.key, *[f"[bold]{c}[/]" if distinct and row.section == "metric" else c
                                              for c in cells])
    console.print(table)


def main(argv: list[str]) -> int:
    """`tidal compare [RUN...] [--experiment NAME] [--sweep STUDY] [--group-by policy|sweep] [--uri URI]
    [--all-params]`."""

    default_uri = os.environ.get("MLFLOW_TRACKING_URI") or TrackingConfig.model_fields["mlflow_uri"].default
    ap = argparse.ArgumentParser(prog="tidal compare",
                                 description="Side-by-side table of MLflow runs (or of groups of runs): params that "
                                             "differ, each metric's final value with its mean and min..max over the "
                                             "logged steps.")
    ap.add_argument("runs", nargs="*", metavar="RUN", help="MLflow run ids (or choose runs with --experiment/--sweep)")
    ap.add_argument("--experiment", help="compare the runs of this MLflow experiment (tracking.experiment)")
    ap.add_argument("--sweep", metavar="STUDY", help="compare the trials of this sweep (tag tidal.sweep: the "
                                                     "Optuna study name tidal sweep prints)")
    ap.add_argument("--group-by", choices=sorted(GROUP_TAGS),
                    help="one column per policy (tag tidal.policy) or per sweep (tag tidal.sweep), averaging its runs")
    ap.add_argument("--uri", default=default_uri,
                    help=f"tracking URI (default: $MLFLOW_TRACKING_URI or {default_uri})")
    ap.add_argument("--all-params", action="store_true", help="show every param, not only those that differ")
    args = ap.parse_args(argv)
    run_ids = select_runs(args.uri, args.runs, args.experiment, args.sweep)
    if args.group_by:
        names, rows = compare_groups(run_ids, args.uri, args.group_by)
        print_comparison(names, rows, title=f"{len(run_ids)} runs by {args.group_by} (means over each group's runs)")
    else:
        print_comparison(run_ids, compare_runs(run_ids, args.uri, all_params=args.all_params))
    return 0
