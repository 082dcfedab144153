"""Word times in the worker: found after synthesis, stored beside the audio, pointed at by the index.

``WordTimes.attach`` runs inside the index step of ``store_audio`` (``ttsq.worker.pipeline``): the words
go up first, under ``ttsq.keys.words_key`` of the job's content key (idempotent: a rerun writes the
same key), and the index entry that names them is written last, as the audio's is. The words come from
the engine when it times its own (espeak-ng's word events, the same on every run), else from the
aligner ``TTSQ_ALIGNER`` names (loaded on first use) run on the stored file, so that they always fit
the audio that is kept. A document's words are its chunks' words, each moved by its chunk's exact
start in the stitched file (``WordTimes.document``, from the stitch's join: crossfades and pauses
included).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ttsq.alignment import Aligner, Word, create_aligner, parse_words, words_to_json
from ttsq.audio import decode
from ttsq.keys import canonical_json, words_key
from ttsq.results import checked_key, checked_words_key

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.engines.base import EngineOutput
    from ttsq.job import StoredAudio, SynthesisRequest
    from ttsq.storage import Storage

logger = logging.getLogger(__name__)


class WordTimes:
    """Finds and stores word times for one worker (its settings and storage). Thread-safe: task threads
    share it, and the aligner runs one job at a time."""

    def __init__(self, settings: Settings, storage: Storage) -> None:
        self.settings = settings
        self.storage = storage
        self._aligner: Aligner | None = None
        self._lock = threading.Lock()

    def aligner(self) -> Aligner:
        """The configured aligner, built on first use."""
        with self._lock:
            if self._aligner is None:
                self._aligner = create_aligner(self.settings.aligner, self.settings)
            return self._aligner

    def words(self, request: SynthesisRequest, output: EngineOutput, entry: StoredAudio) -> list[Word]:
        """The words of ``request``: the engine's own, else the aligner's on the stored file (``entry``'s
        object). The stored file, not this run's samples: when an earlier run of the key stored its audio
        first (a redelivery), a sampling engine's two runs differ, and the words must fit what is kept."""
        if output.words is not None:
            return list(output.words)
        started = time.perf_counter()
        aligner = self.aligner()
        samples, rate = decode(self.storage.get(checked_key(entry["object_key"])))
        with self._lock:  # one alignment at a time: the models are not shared between threads
            words = aligner.align(samples, rate, request.text, request.language)
        logger.info("aligned %d words with %s in %.2fs", len(words), aligner.name, time.perf_counter() - started)
        return words

    def attach(self, request: SynthesisRequest, key: str, output: EngineOutput, entry: StoredAudio) -> StoredAudio:
        """``entry``, for a request that asked for timestamps with its words stored and named in it
        (``words_key``, set in place: the caller's ``Stored.audio`` is this entry, and builds the
        result); any other request's entry as it is."""
        if request.timestamps is None:
            return entry
        target = words_key(key)
        self.storage.put(target, canonical_json(words_to_json(self.words(request, output, entry))), "application/json")
        entry["words_key"] = target
        return entry

    def document(
        self, key: str, entries: Sequence[StoredAudio | None], edges: Sequence[tuple[int, int]], rate: int
    ) -> str | None:
        """Store a stitched document's words (its chunks', each moved by its start sample in ``edges``)
        and return where; None when its chunks have no words (it did not ask for them)."""
        present = [entry for entry in entries if entry is not None]
        if not present or not all("words_key" in entry for entry in present):
            return None
        words: list[Word] = []
        for entry, (start, _) in zip(entries, edges, strict=True):
            if entry is None:
                continue
            chunk = parse_words(json.loads(self.storage.get(checked_words_key(entry.get("words_key")))))
            words += [word.shifted(start / rate) for word in chunk]
        target = words_key(key)
        self.storage.put(target, canonical_json(words_to_json(words)), "application/json")
        return target
