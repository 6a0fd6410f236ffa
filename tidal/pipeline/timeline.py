"""Device x time record of a run: which role held each device, and when it was busy.

Every component reports busy intervals `(device, role, what, t0, t1)`; ownership spans come from the device
ledger's history. From them: the device idle fraction over a named window, 1 - busy device-seconds / owned
device-seconds (using the actual device count over time, not the initial one), and a picture (one row per device,
colored by role, solid where busy, pale where the role holds the device but does nothing; a dashed line labelled
"step N" where step N starts; the x axis in seconds since the run's start, that start's UTC time in its label).

Faults (`tidal.pipeline.faults`, `tidal.pipeline.rejoin`) on the failed device's lane, apart from busy and owned
(a failed device is in no role, so they count neither as work nor as idle time):

    dev 2  ███████ generate ████✕░░░░░░░░ failed: <reason> ░░░░░░░░▲██ generate ██   ✕ failure, ░ down (FAILED),
                                ▔▔▔▔▔ recovery 3.10s                                 ▔ failure -> work redone,
                                                                                     ▲ rejoined (FAILED -> FREE)

The idle fraction's windows, one definition each (`tidal.pipeline.run_metrics` logs them):

    step/idle_fraction        [step start, step start + step/time_s]    `idle_fraction(t0, t1)`, by the driver
    run/step_idle_fraction    every step's window, summed               `steps_idle_fraction()`
    run/idle_fraction         [first placement, finish]                 `idle_fraction()`, also timeline.png's title

The run's window holds what the steps' windows leave out: the opening evaluation, evaluations, syncs and
checkpoints between steps, when devices are owned and mostly idle (so `run/idle_fraction` is usually the larger). A
window is recorded by `TrainingRun.record` (`add_step_window`) from the driver's step start and `step/time_s`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:   # matplotlib loads where a picture is drawn, not with the run
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

ROLE_COLORS = {"actor": "#1f77b4", "rollout": "#2ca02c", "inference": "#ff7f0e", "moving": "#7f7f7f",
               "shared": "#9467bd"}
FAULT_COLOR = "#d62728"


@dataclass(frozen=True)
class Span:
    device: int
    role: str
    what: str
    t0: float
    t1: float


@dataclass
class Timeline:
    """Append-only record; times are seconds from the run's start (injected clock)."""

    busy: list[Span] = field(default_factory=list)
    owned: list[Span] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)   #: (RL step, the time it started)
    #: a device FAILED (`what`: the reason); `role` "rejoined" where it came back at t1, else "failed"
    down: list[Span] = field(default_factory=list)
    recovery: list[Span] = field(default_factory=list)   #: a failure -> its lost work done again (`what`: seconds)
    #: (RL step, t0, t1): the window of each step's `step/idle_fraction` and `step/time_s`
    step_windows: list[tuple[int, float, float]] = field(default_factory=list)

    def mark_step(self, step: int, t: float) -> None:
        self.steps.append((step, t))

    def add_step_window(self, step: int, t0: float, t1: float) -> None:
        self.step_windows.append((step, t0, max(t0, t1)))

    def add_busy(self, devices: Iterable[int], role: str, what: str, t0: float, t1: float) -> None:
        self.busy.extend(Span(d, role, what, t0, t1) for d in devices if t1 > t0)

    def add_owned(self, devices: Iterable[int], role: str, t0: float, t1: float) -> None:
        self.owned.extend(Span(d, role, "owned", t0, t1) for d in devices if t1 > t0)

    def add_down(self, device: int, reason: str, t0: float, t1: float, rejoined: bool) -> None:
        self.down.append(Span(device, "rejoined" if rejoined else "failed", reason, t0, max(t0, t1)))

    def add_recovery(self, device: int, what: str, t0: float, t1: float) -> None:
        self.recovery.append(Span(device, "recovery", what, t0, max(t0, t1)))

    def idle_fraction(self, t0: float | None = None, t1: float | None = None) -> float:
        """1 - busy / owned device-seconds within [t0, t1]; by default the whole run, from the first ownership
        span's start to the last one's end (`run/idle_fraction`)."""
        lo = min((s.t0 for s in self.owned), default=0.0) if t0 is None else t0
        hi = max((s.t1 for s in self.owned), default=0.0) if t1 is None else t1
        return _idle(*self.device_seconds(lo, hi))

    def steps_idle_fraction(self) -> float:
        """1 - busy / owned device-seconds summed over the steps' windows (`run/step_idle_fraction`): the
        device-second weighted mean of the steps' `step/idle_fraction`."""
        return self.windows_idle_fraction((t0, t1) for _, t0, t1 in self.step_windows)

    def windows_idle_fraction(self, windows: Iterable[tuple[float, float]]) -> float:
        """1 - busy / owned device-seconds summed over `windows` (which must not overlap)."""
        busy = owned = 0.0
        for t0, t1 in windows:
            b, o = self.device_seconds(t0, t1)
            busy, owned = busy + b, owned + o
        return _idle(busy, owned)

    def device_seconds(self, lo: float, hi: float) -> tuple[float, float]:
        """(busy, owned) device-seconds within [lo, hi]; overlapping busy spans on a device count once."""
        owned = sum(max(0.0, min(s.t1, hi) - max(s.t0, lo)) for s in self.owned)
        busy = 0.0
        for dev in {s.device for s in self.busy}:
            spans = sorted((max(s.t0, lo), min(s.t1, hi)) for s in self.busy if s.device == dev)
            end = lo
            for a, b in spans:
                a = max(a, end)
                if b > a:
                    busy += b - a
                    end = b
        return busy, owned

    def role_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.busy:
            out[s.role] = out.get(s.role, 0.0) + (s.t1 - s.t0)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"busy": [s.__dict__ for s in self.busy], "owned": [s.__dict__ for s in self.owned],
                "steps": [{"step": n, "t0": t} for n, t in self.steps],
                "down": [s.__dict__ for s in self.down], "recovery": [s.__dict__ for s in self.recovery],
                "step_windows": [{"step": n, "t0": t0, "t1": t1} for n, t0, t1 in self.step_windows]}

    def draw(self, path: str | Path, title: str = "", origin: float | None = None) -> None:
        """The picture (`figure`) as a PNG at `path`."""
        import matplotlib.pyplot as plt
        fig = self.figure(title, origin)
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def figure(self, title: str = "", origin: float | None = None) -> Figure:
        """The picture as a matplotlib Figure. `origin`: unix time of t = 0 (the run's start), named in the x
        axis' label."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        devices = sorted({s.device for s in self.owned} | {s.device for s in self.busy} | {s.device for s in self.down})
        fig, ax = plt.subplots(figsize=(12, 0.45 * len(devices) + 1.5))
        for s in self.owned:
            ax.broken_barh([(s.t0, s.t1 - s.t0)], (s.device - 0.4, 0.8), color=ROLE_COLORS.get(s.role, "k"),
                           alpha=0.18, linewidth=0)
        for s in self.busy:
            ax.broken_barh([(s.t0, s.t1 - s.t0)], (s.device - 0.4, 0.8), color=ROLE_COLORS.get(s.role, "k"),
                           alpha=0.9, linewidth=0)
        self._draw_faults(ax)
        ax.set_yticks(devices)
        ax.set_yticklabels([f"dev {d}" for d in devices])
        ax.invert_yaxis()
        for step, t in self.steps:
            ax.axvline(t, color="k", linestyle="--", linewidth=0.8, alpha=0.6)
            ax.annotate(f"step {step}", (t, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 2),
                        textcoords="offset points", fontsize=8, ha="center", va="bottom")
        ax.set_xlabel(axis_label(origin))
        ax.set_title(title or timeline_title("device timeline", self.idle_fraction()), pad=16)
        # below the axes (inside, it would hide the devices' spans and the step labels): a 0.3 inch strip
        fig.legend(handles=[Patch(color=c, label=r) for r, c in ROLE_COLORS.items()], loc="lower center",
                   fontsize=8, ncol=len(ROLE_COLORS), frameon=False)
        fig.tight_layout(rect=(0.0, 0.3 / fig.get_figheight(), 1.0, 1.0))
        return fig

    def _draw_faults(self, ax: Axes) -> None:
        """On each failed device's lane: ✕ at the failure, the FAILED span hatched (its reason written where it
        fits), ▲ where it rejoined, and a bar under the lane from the failure to its work done again, labelled
        with the seconds."""
        for s in self.down:
            ax.broken_barh([(s.t0, s.t1 - s.t0)], (s.device - 0.4, 0.8), facecolor="none", edgecolor=FAULT_COLOR,
                           hatch="////", linewidth=0.6)
            ax.plot([s.t0], [s.device], marker="x", color=FAULT_COLOR, markersize=9, mew=2)
            ax.annotate(f"failed: {s.what}"[:60], (s.t0, s.device - 0.1), xytext=(6, 0), textcoords="offset points",
                        fontsize=7, color=FAULT_COLOR, va="center", clip_on=True)
        for s in self.recovery:
            ax.broken_barh([(s.t0, max(s.t1 - s.t0, 1e-3))], (s.device + 0.28, 0.12), color=FAULT_COLOR,
                           linewidth=0)
            ax.annotate(s.what, (s.t0, s.device + 0.34), xytext=(6, 0), textcoords="offset points", fontsize=7,
                        color=FAULT_COLOR, va="center")
        for s in self.down:
            if s.role == "rejoined":
                ax.plot([s.t1], [s.device], marker="^", color=FAULT_COLOR, markersize=8)


def _idle(busy: float, owned: float) -> float:
    """1 - busy / owned, in [0, 1]; 0 where nothing was owned (no device to be idle)."""
    return 0.0 if owned <= 0 else max(0.0, min(1.0, 1.0 - busy / owned))


def timeline_title(what: str, run_idle_fraction: float) -> str:
    """The picture's title: `what`, then `run/idle_fraction` under its name, as the summary and MLflow give it."""
    return f"{what} (run/idle_fraction {run_idle_fraction:.2f})"


def axis_label(origin: float | None) -> str:
    """The x axis' label: seconds since the run's start, at UTC time `origin` (unix seconds) when known."""
    if origin is None:
        return "seconds since run start"
    at = datetime.fromtimestamp(origin, tz=UTC).isoformat(timespec="seconds")
    return f"seconds since run start ({at})"
