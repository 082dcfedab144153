"""The Celery worker: the tasks, the envelope gate in front of them, and the job pipeline behind them.

``tasks`` registers the public task names; ``gate`` and ``envelope`` check every message before Celery
parses it; ``runtime`` builds a worker's collaborators; ``documents`` fans out and stitches long
documents; ``sweeper``, ``watchdog``, ``metrics`` and ``health`` keep the fleet honest and visible.
"""
