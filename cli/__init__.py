"""The ``ttsq`` command line, installed as ``ttsq.cli`` (see the README's layout section)."""
