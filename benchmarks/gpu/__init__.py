"""The GPU suite: every GPU figure of ttsq from one call of the device machine (see suite.py)."""
