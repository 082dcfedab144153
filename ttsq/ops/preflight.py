"""Checks a benchmark makes before it starts anything: what would fail minutes later, said at once."""

from __future__ import annotations

import os
import subprocess
import sys


def require_command_line() -> None:
    """Exit at once, with the command that fixes it, when ``python -m ttsq.cli.main`` (how benchmarks
    start workers and gateways) cannot start from the current folder.

    Python puts the current folder first on ``sys.path`` for ``-m``: run from a checkout after a plain
    ``pip install .``, the source tree's ``ttsq/`` shadows the installed package, and it has no
    ``ttsq.cli`` (``cli/`` is installed under that name, not kept there). Every worker a benchmark starts
    then dies at import, and the benchmark only notices when its workers never answer."""
    probe = subprocess.run(
        [sys.executable, "-c", "import ttsq.cli.main"], cwd=os.getcwd(), capture_output=True, text=True, timeout=120
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        sys.exit(
            f"`python -m ttsq.cli.main` does not start from {os.getcwd()} ({last}): the source tree here "
            "shadows the installed ttsq. Install it editable: pip install -e '.[gateway]' (or run the "
            "benchmark from another folder)"
        )
