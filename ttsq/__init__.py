"""ttsq: distributed text-to-speech on Celery and Redis.

Follow one job through the modules in this order: ``request`` (what a job is) → ``keys`` (its
content hash) → ``client`` (cache short-circuit, single flight, enqueue) → ``tasks`` (the Celery
task) → ``worker`` (re-check, batch, encode, store, index) → ``batching`` → ``engines`` →
``audio`` → ``storage`` → ``cache``.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"

# A library logs where its user configures logging, and nowhere else: without this, a warning from a
# producer (a storage retry) would reach the command line's stderr through Python's last resort handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())
