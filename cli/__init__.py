"""The ``ttsq`` command line, installed as ``ttsq.cli`` (see docs/development.md, "Repository layout")."""
