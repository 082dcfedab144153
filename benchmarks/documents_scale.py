"""What a long document costs the broker, Redis and the stitching worker, by length and format (issue 26).

    python benchmarks/documents_scale.py [--sizes 10000,50000] [--formats ogg,mp3,wav]

Starts a private Redis, a local storage folder and one ``ttsq worker`` process (espeak), then for each
size (text like ``tests/document_corpus.py``) submits the document once per format through ``Client``
and prints, per run:

- **msg B**: the largest chunk message seen in the queue (sampled while the fan-out runs);
- **redis MB**: Redis's ``used_memory`` peak above its level before the document (sampled, and
  ``INFO memory``'s ``used_memory_peak`` where it moved);
- **worker RSS MB**: the worker's peak resident memory above its level before the document
  (``/proc/PID/status`` ``VmHWM``, reset through ``clear_refs`` before each run);
- **fan-out s / stitch s**: from the worker's log lines ``document ...: N chunks ... sent in T s`` and
  ``stitched ... in T s``; **total s**: submit to result.

Every format of one size shares the same chunks (the seed comes from the text, not the format): the
first format of a size pays for synthesis, the others find the chunks in the cache but still fan
out every chunk message and stitch the whole file.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path

import redis

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer


def corpus(chars: int) -> str:
    """The document of the tests (``tests/document_corpus.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    text: str = importlib.import_module("document_corpus").corpus(chars)
    # The corpus ends on a whole sentence past ``chars``: cut back to a word under it, so that the
    # largest size can be the document limit itself.
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0]


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


class Sampler:
    """Polls Redis memory and the queue's newest messages while a document runs."""

    def __init__(self, client: redis.Redis, queue: str) -> None:
        self.client = client
        self.queue = queue
        self.base = int(client.info("memory")["used_memory"])
        self.peak = self.base
        self.largest_chunk_message = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, int(self.client.info("memory")["used_memory"]))
            for item in self.client.lrange(self.queue, 0, 3):
                if b"ttsq.synthesize" in item:
                    self.largest_chunk_message = max(self.largest_chunk_message, len(item))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,50000", help="document lengths in characters, comma-separated")
    parser.add_argument("--formats", default="ogg,mp3,wav", help="output formats, comma-separated")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds to wait for one document")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    formats = args.formats.split(",")

    server = RedisServer().start()
    folder = tempfile.mkdtemp(prefix="ttsq-bench-")
    log_path = Path(folder) / "worker.log"
    settings = Settings.from_env(
        broker_url=server.url,
        result_backend=server.url,
        cache_url=server.url,
        storage_url=str(Path(folder) / "store"),
        engine="espeak",
        metrics_port=0,
        max_document_chars=max(200_000, *sizes),
        queue="bench-scale",
    )
    # The smallest visibility timeout the startup check accepts: no fan-out or stitch may outgrow it.
    settings = settings.replace(visibility_timeout_s=settings.min_visibility_timeout_s)
    print(f"visibility timeout {settings.visibility_timeout_s} s (the smallest the startup check accepts)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env |= {f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)}
    with log_path.open("ab") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", "bench@localhost"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    rows: list[str] = []
    try:
        watcher = redis.Redis.from_url(server.url)
        client = Client(settings)
        deadline = time.monotonic() + 120
        while not client.identities() and time.monotonic() < deadline:
            time.sleep(0.2)
        print(
            f"{'chars':>7} {'chunks':>6} {'format':>6} {'audio s':>8} {'msg B':>7} {'redis MB':>9} "
            f"{'worker RSS MB':>13} {'fan-out s':>9} {'stitch s':>8} {'total s':>8} {'fan-outs':>8} {'stitches':>8}",
            flush=True,
        )
        for size in sizes:
            text = corpus(size)
            for audio_format in formats:
                Path(f"/proc/{worker.pid}/clear_refs").write_text("5")  # our own process: reset VmHWM
                rss_before = status_kb(worker.pid, "VmRSS")
                peak_before = int(watcher.info("memory")["used_memory_peak"])
                sampler = Sampler(watcher, settings.queue)
                started = time.perf_counter()
                job = client.submit_document(text, format=audio_format)
                result = job.wait(timeout=args.timeout)
                total_s = time.perf_counter() - started
                sampler.stop()
                hwm = status_kb(worker.pid, "VmHWM")
                peak_after = int(watcher.info("memory")["used_memory_peak"])
                redis_peak = max(sampler.peak, peak_after if peak_after > peak_before else 0) - sampler.base
                log_text = log_path.read_text(errors="replace")
                fan = re.search(rf"document {job.id}: (\d+) chunks .* sent in ([\d.]+)s", log_text)
                stitch = re.search(rf"document {job.id}: stitched .* in ([\d.]+)s", log_text)
                # Exactly one of each: a redelivered fan-out or stitch would log its own line.
                fan_outs = len(re.findall(rf"document {job.id}: \d+ chunks", log_text))
                stitches = len(re.findall(rf"document {job.id}: stitched", log_text))
                row = (
                    f"{len(text):>7} {fan.group(1) if fan else '?':>6} {audio_format:>6} "
                    f"{result['duration_s']:>8.0f} {sampler.largest_chunk_message:>7} "
                    f"{redis_peak / 1e6:>9.1f} {(hwm - rss_before) / 1024:>13.1f} "
                    f"{fan.group(2) if fan else '?':>9} {stitch.group(1) if stitch else '?':>8} {total_s:>8.1f} "
                    f"{fan_outs:>8} {stitches:>8}"
                )
                rows.append(row)
                print(row, flush=True)
        client.close()
        watcher.close()
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
