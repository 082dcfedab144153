"""Tools for operating ttsq, outside the job path: the load generator behind ``ttsq bench``."""
