"""OpenAI's speech answered while it is made: the audio of one ``POST /v1/audio/speech``, in its response
format, as the worker's pieces arrive (docs/streaming.md, docs/gateway.md).

Where the audio comes from:

- a cache hit at the gateway: the stored file, at once, its bytes as they are read from storage;
- a job that streams (``stream: true``, which the gateway sets on every single job of the speech route):
  its stream, read through the process's one ``StreamReader``, each piece encoded on arrival
  (``ttsq.gateway.encoders``); a cache hit at the worker, or a job joined to an identical one that does
  not stream (single flight), ends with the stored file once it is done, as ``AudioStream`` does; a
  reader that came late, or whose client fell so far behind that the stream's window moved past it,
  goes on from the stored file at the sample it had reached (``ttsq.records.playback`` says when);
- a document (longer than one job): its stitched audio chunk by chunk in reading order, each chunk once
  it is complete, joined as the stitch joins it (``ttsq.client.DocumentStream``, on a thread: a playing
  document holds one thread of the gateway's pool while it waits for its next chunk);
- ``flac`` (``encoders.stream_from_worker``): the stored file once the job is done.

Failures before the first audio are HTTP errors in OpenAI's shape, as before (a cancelled job 410, a
failed one 500, no audio in time 504). After it, the response has already said 200: a stream that
breaks (its job run again after pieces were sent, no piece for ``playback.STALL_S``, a job that failed) raises
``Interrupted`` from the body, which SSE turns into a ``speech.audio.error`` event and the raw response
into a connection closed before its last chunk (``ttsq.gateway.middleware.Observe``): never a short clip
that looks complete.

Words (a request with ``timestamps: "word"``, docs/timestamps.md, "Streams"): each source yields its
audio as ``Sound``s, bytes with the words they complete; SSE deltas carry them, the raw body drops them.

Why one file over 400 lines: every source above feeds the same two bodies through one ``Sound`` iterator
with one way of failing before and after the first audio; split, each half would restate it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
from celery import states

from ttsq.audio import decode, pcm_pieces
from ttsq.client import DocumentStream
from ttsq.engines.base import FRAMES_PER_SECOND
from ttsq.errors import CorruptRecord, InvalidRequest, JobFailed, JobParked, JobTimeout, StreamBroken, TTSQError
from ttsq.gateway.encoders import Encoder, PcmEncoder, encoder
from ttsq.gateway.errors import ApiError, Interrupted
from ttsq.records.playback import (
    RATES,
    Broken,
    CheckState,
    Done,
    Failed,
    FromStored,
    Play,
    Playback,
    WordFeed,
    Words,
    result_words,
    stored_pcm,
)
from ttsq.results import checked_key

if TYPE_CHECKING:
    from ttsq.alignment import Word
    from ttsq.client import Job
    from ttsq.gateway.openai import Speech
    from ttsq.gateway.state import Gateway
    from ttsq.job import JobResult
    from ttsq.results import StoredResult

logger = logging.getLogger(__name__)

#: Readers wait for entries in ticks of this long (seconds).
TICK_S = 1.0
#: Seconds of audio per piece when a stored WAV is sent as pcm.
STORED_PIECE_S = 0.5


class ClientGone(Exception):
    """The client disconnected while waiting for the first audio."""


class Sound(NamedTuple):
    """Bytes of the response's audio (possibly none), and the words they complete."""

    audio: bytes
    words: tuple[Word, ...] = ()


class SpeechAudio:
    """The audio of one speech request: ``first()`` waits for its first bytes (raising HTTP errors),
    then ``raw()`` or ``sse()`` is the response body."""

    def __init__(
        self, gateway: Gateway, job: Job, speech: Speech, *, streamed: bool, arrived: float, document: bool = False
    ) -> None:
        self.gateway = gateway
        self.job = job
        self.speech = speech
        self.streamed = streamed
        self.document = document
        self.arrived = arrived
        #: The job's result where it is known before the audio (cache hit, stored file).
        self.result: JobResult | None = job.result
        #: Request fields the engine ignored (from the result, or the stream's ``end``).
        self.ignored: list[str] = []
        #: Seconds of audio sent from the job's stream (what the key's quota is charged for a stream).
        self.streamed_s = 0.0
        self.source = "cache" if job.result is not None else ("stream" if streamed else "stored")
        self._chunks = self._audio()
        self._first: Sound | None = None
        self._disconnected: Callable[[], Awaitable[bool]] | None = None
        self._timed = False

    async def first(self, disconnected: Callable[[], Awaitable[bool]]) -> None:
        """Wait for the first audio bytes; failures before them raise as HTTP errors (``ApiError``,
        ``JobTimeout``), a client gone meanwhile raises ``ClientGone``."""
        self._disconnected = disconnected
        try:
            self._first = await self._next()
        except Interrupted as exc:  # nothing sent yet: an HTTP error is still possible
            raise ApiError(500, exc.message, type="server_error", code=exc.code) from None
        finally:
            self._disconnected = None

    def headers(self) -> dict[str, str]:
        """``X-TTSQ-*``: the content key, whether it was a cache hit, the job id, what was ignored."""
        headers = {"X-TTSQ-Cached": str(self.job.result is not None).lower()}
        key = self.result["key"] if self.result is not None else self.job.key
        if key:
            headers["X-TTSQ-Key"] = key
        if self.job.id:
            headers["X-TTSQ-Job-Id"] = self.job.id
        reported = [*self.speech.ignored, *(self.result.get("ignored", []) if self.result else [])]
        if reported:
            headers["X-TTSQ-Ignored"] = ",".join(dict.fromkeys(reported))
        return headers

    async def raw(self) -> AsyncIterator[bytes]:
        """``stream_format: audio``: the bytes; ``Interrupted`` propagates (the response is broken off)."""
        sound = self._first
        while sound is not None:
            if sound.audio:
                yield sound.audio
            sound = await self._next()

    async def sse(self) -> AsyncIterator[bytes]:
        """``stream_format: sse``: ``speech.audio.delta`` events, then ``speech.audio.done`` (or
        ``speech.audio.error``)."""
        try:
            sound = self._first
            while sound is not None:
                delta: dict[str, Any] = {"type": "speech.audio.delta", "audio": base64.b64encode(sound.audio).decode()}
                if sound.words:
                    delta["words"] = [word.to_dict() for word in sound.words]
                yield _event(delta)
                sound = await self._next()
        except Interrupted as exc:
            yield _event(exc.event())
            return
        done: dict[str, Any] = {"type": "speech.audio.done", "usage": self.usage(), "duration_s": self.duration_s}
        if self.ignored:
            done["ignored"] = self.ignored
        yield _event(done)

    def usage(self) -> dict[str, int]:
        """OpenAI's ``usage`` in what ttsq counts (no tokenizer at the gateway): the input's characters, the
        audio's Qwen3-TTS codec frames (12.5 a second: a Qwen3-TTS server's output tokens)."""
        chars, frames = len(self.speech.text), round(self.duration_s * FRAMES_PER_SECOND)
        return {"input_tokens": chars, "output_tokens": frames, "total_tokens": chars + frames}

    @property
    def duration_s(self) -> float:
        """Seconds of audio the response carries (the stored file's, or what was streamed)."""
        if self.result is not None and self.source != "stream":
            return float(self.result["duration_s"])
        return round(self.streamed_s, 4)

    async def _next(self) -> Sound | None:
        """The next audio bytes or words, None at the end."""
        try:
            chunk = await self._chunks.__anext__()
        except StopAsyncIteration:
            return None
        except (Interrupted, ClientGone):
            raise
        except Exception as exc:
            if not self._timed:
                raise  # nothing sent yet: the gateway's handlers answer it with its HTTP status
            raise _interruption(exc) from None
        if not self._timed:
            self._timed = True
            self.gateway.first_audio.labels(source=self.source).observe(time.perf_counter() - self.arrived)
        return chunk

    async def _audio(self) -> AsyncGenerator[Sound, None]:
        if self.job.result is not None:
            iterator = self._stored(self.job.result)
        elif not self.streamed:
            iterator = self._stored(await self._result())
        elif self.document:
            iterator = self._document()
        else:
            iterator = self._streamed()
        async with contextlib.aclosing(iterator):  # closed with this one: the stream's reader goes at once
            async for chunk in iterator:
                if chunk.audio or chunk.words:
                    yield chunk

    async def aclose(self) -> None:
        """Stop reading (the client is gone, or the response ended): the job's stream reader is let go."""
        await self._chunks.aclose()

    async def _result(self) -> JobResult:
        return await result_of(self.gateway, self.job)

    async def _stored(self, result: JobResult) -> AsyncGenerator[Sound, None]:
        """The stored file: its bytes as read from storage; for ``pcm``, its samples at 24 kHz. Its words
        come with its first bytes: the whole file is there at once."""
        self.result, self.source = result, self.source if self.source != "stream" else "stored"
        self.ignored = [str(name) for name in result.get("ignored", [])]
        words = tuple(result_words(result))
        storage, object_key = self.gateway.client.storage, checked_key(result["object_key"])
        if self.speech.response_format == "pcm":
            yield Sound(await anyio.to_thread.run_sync(lambda: _as_pcm(storage.get(object_key))), words)
            return
        pieces = await anyio.to_thread.run_sync(storage.stream, object_key)
        while (chunk := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
            yield Sound(chunk, words)
            words = ()

    async def _document(self) -> AsyncGenerator[Sound, None]:
        """A document's stitched audio, chunk by chunk in reading order while later chunks are made: the
        bytes of its stored file for a WAV (``DocumentStream``, whose reads block, on a thread)."""
        fmt = self.speech.response_format
        stream = DocumentStream(self.gateway.client, self.job, timeout=self.gateway.settings.gateway_wait_s)
        pieces = stream.__iter__()  # a generator: closed below, so its reads stop with the response
        coder: Encoder | None = None
        try:
            while True:
                try:
                    piece = await anyio.to_thread.run_sync(next, pieces, None)
                except (JobFailed, JobParked) as exc:
                    if coder is not None:
                        raise Interrupted(str(exc)[:300], "job_failed") from None
                    await self._result()  # the document is over: its own result answers, in OpenAI's shape
                    raise
                except StreamBroken as exc:
                    raise self._broken(str(exc)[:300], "stream_broken", coder is not None) from None
                if piece is None:
                    break
                if not piece.pcm:  # words whose audio went out already
                    yield Sound(b"", piece.words)
                    continue
                if coder is None:
                    coder = encoder(fmt, piece.sample_rate)
                self.streamed_s += len(piece.pcm) / 2 / piece.sample_rate
                yield Sound(await _encoded(coder.feed, piece.pcm, fmt), piece.words)
            if coder is not None:
                yield Sound(await _encoded(_finish(coder), b"", fmt))
            if stream.result is not None:
                self.result = stream.result
                self.ignored = [str(name) for name in stream.result.get("ignored", [])]
        finally:
            pieces.close()

    async def _streamed(self) -> AsyncGenerator[Sound, None]:
        """The job's stream, piece by piece, encoded as it comes; from the stored file where the stream
        has moved on (``ttsq.records.playback``, the rules ``ttsq.client.AudioStream`` drives too)."""
        task_id = self.job.source_id or ""
        gateway = self.gateway
        loop_time = anyio.current_time
        playback = Playback(task_id, now=loop_time(), first_audio_by=loop_time() + gateway.settings.gateway_wait_s)
        coder: Encoder | None = None
        resume: FromStored | None = None
        async with gateway.streams.open(task_id) as subscription:
            while resume is None and not playback.over:
                try:
                    entries = await subscription.get(TICK_S)
                except CorruptRecord as exc:
                    raise self._broken(f"job {task_id}: {exc}", "corrupt_record", playback.played) from None
                actions = playback.entries(entries, loop_time())
                if actions and isinstance(actions[-1], CheckState):
                    if self._disconnected is not None and await self._disconnected():
                        raise ClientGone
                    if not (await gateway.waiter.stored(task_id)).done:
                        continue
                    # Over: what the stream still holds comes first; nothing more, and the stored file has it.
                    entries = await subscription.get(TICK_S)
                    actions = playback.entries(entries, loop_time()) if entries else playback.job_over()
                for action in actions:
                    if isinstance(action, Play):
                        if coder is None:
                            coder = encoder(self.speech.response_format, action.sample_rate)
                        self.streamed_s += len(action.pcm) / 2 / action.sample_rate
                        yield Sound(await _encoded(coder.feed, action.pcm, self.speech.response_format), action.words)
                    elif isinstance(action, Words):
                        yield Sound(b"", action.words)
                    elif isinstance(action, FromStored):
                        resume = action
                    elif isinstance(action, Done):
                        ignored = action.payload.get("ignored")
                        if isinstance(ignored, list):
                            self.ignored = [str(name)[:40] for name in ignored[:20]]
                        assert coder is not None
                        yield Sound(await _encoded(_finish(coder), b"", self.speech.response_format))
                    elif isinstance(action, Failed):
                        raise self._failed(task_id, action.kind, action.message, playback.played)
                    elif isinstance(action, Broken):
                        if action.code == "timeout":
                            action = Broken(
                                f"job {task_id}: no audio within {gateway.settings.gateway_wait_s:.0f}s", "timeout"
                            )
                        elif action.code == "stream_broken":
                            action = Broken(
                                f"{action.message}; the job goes on: GET /v1/jobs/{{id}}/audio has the whole file "
                                "once it is done",
                                action.code,
                            )
                        raise self._broken(action.message, action.code, playback.played)
        if resume is None:
            return
        # The reader is let go before the file is read: Redis is no longer read for this response.
        result = await self._result()
        fmt = self.speech.response_format
        if not playback.played:
            if not playback.trimmed or fmt not in ("pcm", "wav"):  # the stored file as it is, as a cache hit
                async for chunk in self._stored(result):
                    yield chunk
                return
            # A late reader: the bytes the stream would have sent (a wav's streamed header, pcm's pieces).
            rate = int(result["sample_rate"])
            if rate not in RATES:
                raise ApiError(500, f"job {self.job.id}: its result names a rate of {rate} Hz", code="corrupt_record")
            coder = encoder(fmt, rate)
            async for chunk in self._rest_of(result, 0, coder, rate, playback.words):
                yield chunk
            return
        assert coder is not None
        async for chunk in self._rest_of(result, resume.offset, coder, playback.sample_rate, playback.words):
            yield chunk

    async def _rest_of(
        self, result: JobResult, offset: int, coder: Encoder, rate: int, words: WordFeed
    ) -> AsyncGenerator[Sound, None]:
        """The stored file's samples from ``offset`` on, through the encoder the stream's pieces went
        through: for pcm and wav the bytes the stream would have sent (its pieces are the stored WAV's
        samples). Read from storage as the client takes them: one storage chunk held at a time. The
        result's words that ``words`` has not said yet come with the pieces that complete them."""
        self.result = result
        self.ignored = [str(name) for name in result.get("ignored", [])]
        words.learn(result_words(result))
        storage, object_key = self.gateway.client.storage, checked_key(result["object_key"])
        chunks = await anyio.to_thread.run_sync(storage.stream, object_key)
        piece_bytes = max(2, int(rate * STORED_PIECE_S) * 2)
        pieces = stored_pcm(iter(lambda: next(chunks, b""), b""), offset, piece_bytes)
        played = offset
        while (pcm := await anyio.to_thread.run_sync(next, pieces, None)) is not None:
            self.streamed_s += len(pcm) / 2 / rate
            played += len(pcm) // 2
            yield Sound(await _encoded(coder.feed, pcm, self.speech.response_format), words.due(played / rate))
        yield Sound(await _encoded(_finish(coder), b"", self.speech.response_format), words.rest())

    def _broken(self, message: str, code: str, played: bool) -> Exception:
        """A stream that cannot go on: before any audio an HTTP error, after it an interruption."""
        if not played and code == "timeout":
            return JobTimeout(message)
        return Interrupted(message, code)

    def _failed(self, task_id: str, kind: str, message: str, played: bool) -> Exception:
        if kind == "JobCancelled":  # as GET /v1/jobs/{id}/audio says it: cancelled, not failed
            if not played:
                return final_state_error(states.REVOKED, task_id)
            return Interrupted(message[:300] or f"job {task_id} was cancelled", "cancelled")
        text = f"job {task_id} failed: {kind}: {message}"
        if not played and kind == "InvalidRequest":
            return ApiError(400, message, code="invalid_value")
        return Interrupted(text, "job_failed")


async def _encoded(call: Callable[[bytes], bytes], pcm: bytes, response_format: str) -> bytes:
    """Encode on a thread where it costs (mp3, opus); pcm and wav are copies."""
    if response_format in ("pcm", "wav"):
        return call(pcm)
    return await anyio.to_thread.run_sync(call, pcm)


def _interruption(exc: Exception) -> Interrupted:
    """A failure after the audio began, as the error that ends the response."""
    if isinstance(exc, ApiError):
        return Interrupted(exc.message, exc.code or "job_failed")
    if isinstance(exc, TTSQError):
        return Interrupted(str(exc)[:300], "stream_broken")
    logger.error("speech stream failed: %s", type(exc).__name__, exc_info=exc)  # the exception, never the request
    return Interrupted("internal error", "internal_error")


def _finish(coder: Encoder) -> Callable[[bytes], bytes]:
    return lambda _: coder.finish()


def _as_pcm(wav: bytes) -> bytes:
    """A stored WAV as OpenAI's pcm, through the same encoder as a stream's pieces."""
    samples, rate = decode(wav)
    coder = PcmEncoder(rate)
    return b"".join([*(coder.feed(piece) for piece in pcm_pieces(samples, rate, STORED_PIECE_S)), coder.finish()])


def _event(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def result_of(gateway: Gateway, job: Job) -> JobResult:
    """The job's result, waiting for it without a thread; failures as HTTP errors."""
    if job.result is not None:
        return job.result
    stored = await gateway.waiter.wait(job.source_id or "", gateway.settings.gateway_wait_s)
    return failed_or_result(gateway, stored)


def failed_or_result(gateway: Gateway, stored: StoredResult) -> JobResult:
    """A final result, or its failure in OpenAI's error shape."""
    if stored.result is not None:
        return gateway.client.refresh_url(stored.result)
    if stored.state == states.REVOKED:
        raise final_state_error(stored.state, stored.task_id)
    if isinstance(stored.error, InvalidRequest):
        raise ApiError(400, str(stored.error), param=stored.error.field, code="invalid_value")
    kind, reason = (stored.failure.kind, stored.failure.reason) if stored.failure else ("error", "")
    raise ApiError(500, f"the job failed: {kind}: {reason[:200]}", type="server_error", code="job_failed")


def final_state_error(state: str | None, job_id: str, reason: str = "") -> ApiError:
    """The answer for a job whose audio will never exist, cancelled (REVOKED) or failed: 410 Gone, a final
    status with no ``Retry-After`` (409 with one invites a client to poll a job that will never be done)."""
    if state == states.REVOKED:
        return ApiError(410, f"job {job_id} was cancelled: it has no audio and never will", code="cancelled")
    detail = f": {reason[:200]}" if reason else ""
    return ApiError(410, f"job {job_id} failed, so it has no audio{detail}", code="job_failed")
