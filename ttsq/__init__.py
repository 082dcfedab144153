"""ttsq: distributed text-to-speech on Celery and Redis.

Follow one job through the modules in this order: ``request`` (what a job is) → ``keys`` (its
content hash) → ``client`` (cache short-circuit, single flight, enqueue) → ``tasks`` (the Celery
task) → ``worker`` (re-check, batch, encode, store, index) → ``batching`` → ``engines`` →
``audio`` → ``storage`` → ``cache``.
"""

from __future__ import annotations

__version__ = "0.1.0"
