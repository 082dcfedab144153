"""``qwen-fast``: the same Qwen3-TTS checkpoints, modes and request contract as ``qwen``, decoded by
ttsq's own loop (``decode.DecodeLoop``) with continuous batching.

Everything around generation (the checkpoint, its identity, frame caps, clone prompts, out-of-memory
handling, the codec call) is the ``qwen`` engine's; only the generation loop and two kinds of the codec's
modules differ. What changes, and what a seed does and does not promise: docs/qwen.md, "qwen-fast: ttsq's
own decode loop".

Streaming rows (``admit(..., piece=...)``) are decoded to audio in chunks while they still generate
(``stream``); their first chunks go to the codec before anything else waiting for it. docs/qwen.md,
"Streaming".

Why one file over 400 lines: admission, the frame, the codec queue and failure handling all share the
slots' bookkeeping (which row, which callback, which stream); the chunks themselves live in ``stream``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.engines.base import EngineOutput, Piece, frame_cap
from ttsq.engines.qwen.engine import SAMPLE_RATE, QwenEngine, is_out_of_memory, release_device_memory, usable_cores
from ttsq.errors import EngineError, EngineOutOfMemory, SharedFailure, TTSQError

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.engines.qwen.decode import DecodeLoop, Finished, Prompt
    from ttsq.engines.qwen.stream import Chunk, RowStream
    from ttsq.job import SynthesisRequest

logger = logging.getLogger(__name__)

#: Cache positions a slot keeps for its prompt (chat template, instruct, text, clone reference codes),
#: on top of the frame cap.
PROMPT_POSITIONS = 1024
#: Of those, what the chat template and codec prefix take (measured: 9 to 15 positions) with room to spare;
#: the rest is the text and instruct, at most one position per UTF-8 byte (byte-level BPE). The identity
#: announces it, so producers refuse a longer text at submit time. A clone's reference codes and
#: transcript also sit in the prompt: a clone job whose prompt still does not fit fails in the worker.
PROMPT_TEMPLATE_POSITIONS = 32

Done = Callable[[EngineOutput | Exception], object]
Rows = list[tuple["Finished", "SynthesisRequest", Done, Any, int]]
#: How much each frame's time moves the loop's recent frame time (an exponential mean over about
#: four frames: a burst's admissions show within its rows' first frames).
FRAME_WEIGHT = 0.3
#: Codec queue priorities: a streaming row's first chunk goes before everything else waiting for the
#: codec; later chunks and whole rows keep their order (so a row's chunks stay in order).
FIRST_CHUNK, IN_ORDER = 0, 1


class QwenFastEngine(QwenEngine):
    """A Qwen3-TTS checkpoint decoded by ttsq's static-cache loop; a ``ContinuousEngine``."""

    name = "qwen-fast"
    #: The batcher's thread and the codec thread run torch at the same time.
    torch_callers = 2
    #: Streaming rows get their audio in chunks while they generate (``ttsq.engines.base.streams_audio``).
    streams_audio = True

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.identity = dataclasses.replace(
            self.identity, max_prompt_bytes=PROMPT_POSITIONS - PROMPT_TEMPLATE_POSITIONS
        )
        self.slots = settings.max_batch
        self.loop: DecodeLoop | None = None
        # slot -> request, its done callback, its clone reference codes, its frame cap
        self._requests: dict[int, tuple[SynthesisRequest, Done, Any, int]] = {}
        self._streams: dict[int, RowStream] = {}  # slot -> its streaming row's chunks and pieces
        # The loop's recent frame time (wall, from one step to the next, admissions between them
        # included; idle time not), which sizes streaming rows' first chunks; when the last step began.
        self._frame_s = 0.0
        self._stepped_at: float | None = None
        self._decoder: ThreadPoolExecutor | None = None
        # Work for the codec thread, by (priority, order): every job submitted to ``_decoder`` runs the
        # first job of this heap, so a first chunk overtakes what waits before it.
        self._codec_jobs: list[tuple[int, int, Callable[[], None]]] = []
        self._codec_jobs_lock = threading.Lock()
        self._codec_order = itertools.count()
        self._decode_stream: Any = None
        self._cores = usable_cores()  # read once: the affinity is the process's, fixed at start

    # -- lifecycle --------------------------------------------------------------------------------

    def _attention(self, on_cuda: bool, dtype_name: str) -> str:
        # The loop passes its own slot masks to the attention layers, which only the sdpa (and eager)
        # interfaces take; sdpa itself picks the flash, memory-efficient or cuDNN kernel on CUDA.
        return "eager" if self.settings.qwen_attention == "eager" else "sdpa"

    def load(self) -> None:
        super().load()
        from ttsq.engines.qwen.codec import rewrite
        from ttsq.engines.qwen.decode import DecodeLoop
        from ttsq.engines.qwen.sampling import SubSampling

        # The codec's cheaper equivalents (same audio within float rounding): half the codec's time
        # on the tiny checkpoint's CPU decode, a fifth on the full size.
        swapped = rewrite(self._tts.model.speech_tokenizer.model.decoder)
        logger.debug("qwen-fast: %d codec decoder modules swapped for their cheaper equivalents", swapped)
        defaults = self._tts._merge_generate_kwargs()
        sub = SubSampling(
            do_sample=bool(defaults["subtalker_dosample"]),
            temperature=float(defaults["subtalker_temperature"]),
            top_k=int(defaults["subtalker_top_k"]),
            top_p=float(defaults["subtalker_top_p"]),
        )
        on_cuda = self._device.startswith("cuda")
        # Streams, events and graphs belong to the thread's current device, which is cuda:0 unless set:
        # on cuda:N the loop's thread (this one, the batcher's) and the codec thread must both say so.
        index = self._torch.device(self._device).index if on_cuda else None
        if index is not None:
            self._torch.cuda.set_device(index)
        self.loop = DecodeLoop(
            self._tts.model,
            slots=self.slots,
            positions=self.settings.qwen_max_frames + PROMPT_POSITIONS,
            max_frames=self.settings.qwen_max_frames,
            sub=sub,
            graphs=on_cuda,
        )
        # Finished rows are decoded to audio on their own thread (and, on CUDA, their own stream) while
        # the loop goes on with the others: the codec is a large share of the work per frame.
        if index is not None:
            self._decoder = ThreadPoolExecutor(
                1, thread_name_prefix="ttsq-codec", initializer=self._torch.cuda.set_device, initargs=(index,)
            )
        else:  # each thread has its own OpenMP team: the codec's gets its share of the cores too
            self._decoder = ThreadPoolExecutor(
                1,
                thread_name_prefix="ttsq-codec",
                initializer=self._torch.set_num_threads,
                initargs=(self.torch_threads,),
            )
        if on_cuda:
            self._decode_stream = self._torch.cuda.Stream(device=self._device)

    def warmup(self) -> None:
        """The stock warm-up (codec included), then a short row through the loop; on CUDA, capture
        every (rows, length) bucket; then a first chunk's decode."""
        super().warmup()
        loop = self.loop
        assert loop is not None
        from ttsq.engines.qwen.sampling import Sampling

        voice = None
        if self.mode == "voice_clone":
            t = np.arange(SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE
            tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
            with self._torch.inference_mode():
                voice = self._tts.create_voice_clone_prompt(ref_audio=[(tone, SAMPLE_RATE)], ref_text=["Warm up."])[0]
        speaker = self.identity.speakers[0] if self.mode == "custom_voice" else ""
        with self._torch.inference_mode():
            prompt = self._prompt("Warm up.", "auto", "", speaker, voice)
        loop.admit(prompt, cap=4, sampling=Sampling(seed=0))
        while loop.active:
            loop.step()
        for rows, length in loop.buckets():
            loop.capture(rows, length)
        # A streaming row's first chunk is two frames at least: decode that shape once, so first audio pays no
        # first-call costs either.
        from ttsq.engines.qwen.stream import FIRST_CHUNK_FRAMES, decode_windows

        decoder = self._tts.model.speech_tokenizer.model.decoder
        shape = (FIRST_CHUNK_FRAMES, int(decoder.config.num_quantizers))
        decode_windows(decoder, [(self._torch.zeros(shape, dtype=self._torch.long, device=self._device), 0)])

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)
            self._decoder = None
        for slot in list(self._requests):
            self._fail(slot, EngineError("the engine closed before this job finished"))
        self.loop = None
        super().close()

    # -- continuous batching ----------------------------------------------------------------------

    @property
    def active(self) -> int:
        return 0 if self.loop is None else self.loop.active

    def free_slots(self) -> int:
        return 0 if self.loop is None else self.loop.free_slots()

    def admit(self, request: SynthesisRequest, done: Done, piece: Piece | None = None) -> None:
        """Prefill one request into a free slot; its output goes to ``done``. With ``piece``, its audio
        also goes there in chunks while it generates, and its output is exactly those chunks, joined."""
        loop = self.loop
        if loop is None:
            raise EngineError("qwen-fast engine used before load()")
        from ttsq.engines.qwen.sampling import Sampling
        from ttsq.engines.qwen.stream import RowStream

        try:
            self.identity.check(request)
            voice = self._clone_prompt(request.reference) if self.mode == "voice_clone" else None
            cap = min(
                request.max_new_tokens or frame_cap(request.text, self.settings.qwen_max_frames),
                self.settings.qwen_max_frames,
            )
            with self._torch.inference_mode():
                prompt = self._prompt(request.text, request.language, request.instruct, request.speaker, voice)
                if not loop.fits(prompt, cap):
                    raise EngineError(
                        f"the prompt ({prompt.embeds.shape[1]} positions) is longer than the "
                        f"{PROMPT_POSITIONS} a slot keeps for it"
                    )
                merged = self._tts._merge_generate_kwargs(
                    temperature=request.temperature,
                    top_p=request.top_p,
                    top_k=request.top_k,
                    repetition_penalty=request.repetition_penalty,
                )
                sampling = Sampling(
                    do_sample=bool(merged["do_sample"]),
                    temperature=float(merged["temperature"]),
                    top_k=int(merged["top_k"]),
                    top_p=float(merged["top_p"]),
                    repetition_penalty=float(merged["repetition_penalty"]),
                    seed=request.seed if request.seed is not None else secrets.randbits(32),
                )
                slot = loop.admit(prompt, cap=cap, sampling=sampling)
            self._requests[slot] = (request, done, prompt.ref_code, cap)
            if piece is not None:
                self._streams[slot] = RowStream(piece, done, request, cap, prompt.ref_code)
            return
        except TTSQError as exc:
            failure: Exception = exc
        except Exception as exc:
            if not is_out_of_memory(self._torch, exc):
                failure = EngineError(f"cannot start this job: {type(exc).__name__}: {exc}")
            else:
                failure = EngineOutOfMemory(f"out of device memory while starting a job: {exc}")
        if isinstance(failure, EngineOutOfMemory):
            # Outside the handler, so the failed allocation's tensors are released by now.
            release_device_memory(self._torch)
        done(failure)

    def step(self, queued: int = 0) -> None:
        """One frame for every slot; finished rows are decoded and handed to their ``done``. ``queued``:
        the jobs that join as soon as slots free up (the loop goes on after its last rows leave)."""
        loop = self.loop
        if loop is None or not loop.active:
            # Idle: whatever comes next starts afresh (a lone row must not take a first chunk sized
            # for the burst before it).
            self._stepped_at, self._frame_s = None, 0.0
            return
        now = time.perf_counter()
        if self._stepped_at is not None:
            self._frame_s += FRAME_WEIGHT * (now - self._stepped_at - self._frame_s)
        self._stepped_at = now
        try:
            finished = loop.step()
        except Exception as exc:  # the loop's state is unknown now: every row in it leaves
            logger.exception("qwen-fast frame failed; %d jobs leave it", loop.active)
            # Any row may be the cause: a row that decoded beside others is tried again alone (the
            # batcher does so on SharedFailure); a row that was alone is the culprit and fails.
            error = SharedFailure if len(self._requests) > 1 else EngineError
            for slot in list(self._requests):
                loop.cancel(slot)
                self._fail(slot, error(f"decode failed: {type(exc).__name__}: {exc}"))
            return
        from ttsq.engines.qwen.stream import due_chunks

        # Streaming rows whose chunk failed on the codec thread were answered there: they leave.
        for slot in [slot for slot, stream in self._streams.items() if stream.failed]:
            loop.cancel(slot)
            self._requests.pop(slot, None)
            del self._streams[slot]
        # A row without a request (a bug elsewhere) must not keep the others from being answered.
        rows = [(row, *entry) for row in finished if (entry := self._requests.pop(row.slot, None)) is not None]
        whole = [row for row in rows if row[0].slot not in self._streams]
        chunks = due_chunks(loop, self._streams, [row for row, *_ in rows], self._frame_s) if self._streams else []
        if not loop.active:
            self._stepped_at, self._frame_s = None, 0.0
        # The codec's cores are decided here, where it is known whether the loop goes on. Read on the
        # codec thread, the loop looked empty just before the next jobs' admission, and the codec ran
        # a team of all the cores beside the loop for the whole decode of a generation: three busy
        # threads on two cores, a third more CPU for the same audio (docs/benchmarks.md).
        threads = self._codec_threads(beside_loop=bool(loop.active or queued))
        if whole:
            self._dispatch(IN_ORDER, self._decode, whole, [row.codes for row, *_ in whole], threads)
        for priority in (FIRST_CHUNK, IN_ORDER):
            batch = [chunk for chunk in chunks if (priority == FIRST_CHUNK) == chunk.first]
            if batch:
                self._dispatch(priority, self._decode_chunks, batch, [chunk.codes for chunk in batch], threads)

    def cancel(self, done: Done) -> bool:
        """Free the slot of the request ``done`` belongs to (its caller gave up on it)."""
        slot = next((slot for slot, entry in self._requests.items() if entry[1] is done), None)
        if slot is None or self.loop is None:
            return False
        self.loop.cancel(slot)
        self._fail(slot, EngineError("cancelled while decoding: the job's caller gave up on it"))
        return True

    def synthesize_batch(
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None] | None = None
    ) -> list[EngineOutput | Exception]:
        """A whole batch through the slots: rows join as others leave, until every one is done. A row
        with a ``Piece`` in ``pieces`` streams (``admit``)."""
        if self.loop is None:
            raise EngineError("qwen-fast engine used before load()")
        futures: list[Future[EngineOutput | Exception]] = [Future() for _ in requests]
        sinks = list(pieces) if pieces is not None else [None] * len(requests)
        waiting = list(zip(requests, futures, sinks, strict=True))
        while waiting or self.active:
            while waiting and self.free_slots() > 0:
                request, future, piece = waiting.pop(0)
                self.admit(request, future.set_result, piece)
            self.step(queued=len(waiting))
        outputs = [future.result() for future in futures]
        oom = next((out for out in outputs if isinstance(out, EngineOutOfMemory)), None)
        if oom is not None and len(requests) > 1:
            raise oom  # the batcher splits the batch, as for the stock engine
        return outputs

    # -- helpers ----------------------------------------------------------------------------------

    def _prompt(self, text: str, language: str, instruct: str, speaker: str, voice: Any) -> Prompt:
        """The talker inputs stock qwen-tts builds for one row (its own code, captured)."""
        from ttsq.engines.qwen.decode import Prompt

        tts = self._tts
        if self.mode == "voice_design":
            return Prompt.capture(
                tts, lambda: tts.generate_voice_design(text=[text], instruct=[instruct], language=[language])
            )
        if self.mode == "custom_voice":
            return Prompt.capture(
                tts,
                lambda: tts.generate_custom_voice(
                    text=[text], speaker=[speaker], language=[language], instruct=[instruct]
                ),
            )
        prompt = Prompt.capture(
            tts, lambda: tts.generate_voice_clone(text=[text], language=[language], voice_clone_prompt=[voice])
        )
        prompt.ref_code = voice.ref_code if voice.ref_code is not None and voice.icl_mode else None
        return prompt

    def _dispatch(
        self, priority: int, decode: Callable[[Any], None], items: Any, tensors: list[Any], threads: int
    ) -> None:
        """Queue ``decode(items)`` for the codec thread (at once without one); on CUDA, on the codec's
        stream once this stream's work on ``tensors`` is done; on a CPU, with ``threads`` intra-op
        threads."""
        if self._decoder is None:
            decode(items)
            return
        work = functools.partial(decode, items)
        job: Callable[[], None]
        if self._decode_stream is not None:
            event = self._torch.cuda.Event()
            event.record(self._torch.cuda.current_stream(self._device))  # the codes are ready once their frame is
            for tensor in tensors:  # and their memory stays theirs until the codec stream is done with it
                tensor.record_stream(self._decode_stream)
            job = functools.partial(self._decode_on_stream, work, event)
        else:
            job = functools.partial(self._decode_on_threads, work, threads)
        entry: tuple[int, int, Callable[[], None]] = (priority, next(self._codec_order), job)
        with self._codec_jobs_lock:
            heapq.heappush(self._codec_jobs, entry)
        self._decoder.submit(self._next_codec_job)

    def _next_codec_job(self) -> None:
        with self._codec_jobs_lock:
            _, _, job = heapq.heappop(self._codec_jobs)
        job()

    def _decode_on_stream(self, job: Callable[[], None], event: Any) -> None:
        torch = self._torch
        with torch.cuda.stream(self._decode_stream):
            self._decode_stream.wait_event(event)
            job()

    def _decode_on_threads(self, job: Callable[[], None], threads: int) -> None:
        self._torch.set_num_threads(threads)  # the OpenMP team is this thread's own: its size is too
        job()

    def _decode(self, rows: Rows) -> None:
        """Codes to audio as stock qwen-tts decodes them (clone rows with their reference codes in
        front, cut off again), then the ``qwen`` engine's frame-cap cut and truncated flag.

        Runs on the codec thread, where an exception would vanish with its future: every row gets its
        ``done``, whatever fails. If the rows' joint decode fails, each is decoded again alone, so a
        bad row fails only itself (as the batcher retries a failed batch item by item)."""
        answered: set[int] = set()
        try:
            try:
                outputs = self._decode_rows(rows)
            except Exception as exc:
                if len(rows) == 1:
                    raise
                logger.warning(
                    "codec decode of %d rows failed (%s); decoding them one by one", len(rows), type(exc).__name__
                )
                outputs = []
                for row in rows:
                    try:
                        outputs.extend(self._decode_rows([row]))
                    except Exception as alone:
                        outputs.append(EngineError(f"codec decode failed: {type(alone).__name__}: {alone}"))
            for index, ((_, _, done, _, _), output) in enumerate(zip(rows, outputs, strict=True)):
                answered.add(index)
                try:
                    done(output)
                except Exception:  # one job's bookkeeping must not keep the others from theirs
                    logger.exception("a job's done callback failed")
        except BaseException as exc:
            logger.exception("codec decode failed")
            for index, (_, _, done, _, _) in enumerate(rows):
                if index not in answered:
                    done(EngineError(f"codec decode failed: {type(exc).__name__}: {exc}"))
            if not isinstance(exc, Exception):
                raise

    def _decode_rows(self, rows: Rows) -> list[EngineOutput | Exception]:
        torch = self._torch
        with torch.inference_mode():
            inputs = [
                row.codes if ref is None else torch.cat([ref.to(row.codes.device), row.codes], dim=0)
                for row, _, _, ref, _ in rows
            ]
            nonempty = [i for i, codes in enumerate(inputs) if codes.shape[0] > 0]
            wavs: list[Any] = [np.zeros(0, dtype=np.float32)] * len(rows)
            rate = self.identity.sample_rate
            if nonempty:
                decoded, rate = self._tts.model.speech_tokenizer.decode([{"audio_codes": inputs[i]} for i in nonempty])
                for i, wav in zip(nonempty, decoded, strict=True):
                    wavs[i] = wav
        outputs: list[EngineOutput | Exception] = []
        for (row, request, _, ref, cap), wav in zip(rows, wavs, strict=True):
            samples = np.asarray(wav, dtype=np.float32)
            if ref is not None and samples.size:
                total = int(ref.shape[0]) + int(row.codes.shape[0])
                samples = samples[int(int(ref.shape[0]) / max(total, 1) * samples.shape[0]) :]
            outputs.append(self._output(request, samples, int(rate), cap))
        return outputs

    def _codec_threads(self, beside_loop: bool) -> int:
        """The codec thread's share of the cores: half beside a loop that goes on; all of them when the
        loop has stopped (the last rows of a burst, whose audio everyone waits for), unless
        ``TTSQ_TORCH_THREADS`` says otherwise. A job that arrives during such a decode shares the cores
        with it for that one decode."""
        if self.settings.torch_threads or beside_loop:
            return self.torch_threads
        return self._cores

    def _fail(self, slot: int, error: Exception) -> None:
        entry = self._requests.pop(slot, None)
        stream = self._streams.pop(slot, None)
        if entry is None or (stream is not None and not stream.close()):
            return  # a streaming row the codec thread has answered already (its chunk failed)
        entry[1](error)

    # -- streaming rows ---------------------------------------------------------------------------

    def _decode_chunks(self, chunks: list[Chunk]) -> None:
        """Streaming rows' chunks to audio, handed over, rows answered after their last (codec thread)."""
        from ttsq.engines.qwen.stream import Handover

        Handover(
            self._decode_windows,
            samples_per_frame=self._samples_per_frame,
            sample_rate=self.identity.sample_rate,
            ignores_instruct=self.ignores_instruct,
        ).run(chunks)

    def _decode_windows(self, chunks: list[Chunk]) -> list[Any]:
        """The new samples of each chunk, in one call of the codec's decoder (the device boundary)."""
        from ttsq.engines.qwen.stream import decode_windows

        decoder = self._tts.model.speech_tokenizer.model.decoder
        return decode_windows(decoder, [(chunk.codes, chunk.context) for chunk in chunks])
