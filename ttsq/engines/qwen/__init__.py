"""The Qwen3-TTS engines: ``engine`` (stock ``qwen-tts``, batched) and ``fast`` (qwen-fast: continuous
batching over ttsq's own decode loop, ``decode``, with ``layers``, ``sampling``, ``quant`` and the
cheaper codec decoder ``codec``). Every module here may import torch; this package's ``__init__``
imports nothing, so naming an engine never loads it."""
