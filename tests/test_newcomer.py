"""The newcomer's road (issue 43): what a new user meets following the README and docs verbatim.

Each test names the point of the issue's "Why" it covers; the end-to-end one (``ttsq serve
--embedded`` with no redis-server on PATH) is the issue's first acceptance test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

from support import WorkerProcess, settings_env

from ttsq.config import Settings

StartWorker = Callable[..., WorkerProcess]


def test_client_with_no_argument_reads_the_environment(settings: Settings, start_worker: StartWorker) -> None:
    """Why 2: streaming.md's first example is ``Client()`` after ``from ttsq import Client, Settings``."""
    start_worker(settings)
    script = textwrap.dedent(
        """
        from ttsq import Client, Settings

        with Client() as client:
            assert client.settings == Settings.from_env()
            print(client.submit("From the environment.").wait(timeout=60)["duration_s"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=settings_env(settings), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 0.3


def test_settings_is_part_of_the_public_face() -> None:
    import ttsq

    assert "Settings" in ttsq.__all__ and ttsq.Settings is Settings
