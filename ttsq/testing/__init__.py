"""Test support that ships with ttsq (as ``celery.contrib.testing`` does): a tiny random-weight
Qwen3-TTS checkpoint builder and the offline speech-recognition fidelity check. No product code imports
it."""
