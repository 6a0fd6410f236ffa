"""What a result file records about the code that made it: `commit()`, the checkout's git revision.

Benchmarks stamp their JSON with it (with the machine and the date), so a figure names the code it measured.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """TIDAL_COMMIT where the checkout carries no history of its own (a copy on another machine), else the
    checkout's HEAD, else "unknown"."""
    if os.environ.get("TIDAL_COMMIT"):
        return os.environ["TIDAL_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=_ROOT).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
