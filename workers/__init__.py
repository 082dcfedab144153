"""Worker entrypoints, installed as ``ttsq.workers`` (see docs/development.md, "Repository layout")."""
