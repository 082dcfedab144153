"""Worker entrypoints, installed as ``ttsq.workers`` (see the README's layout section)."""
