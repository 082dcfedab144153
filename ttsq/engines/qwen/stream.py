"""qwen-fast's streaming rows: their codes turned into audio in chunks while the row still generates.

The 12 Hz codec's decoder is causal (causal convolutions, transposed convolutions cut on the right,
sliding-window causal attention), so the samples of a frame are final once the frame is decoded and a
chunk's audio can be handed over at once. A chunk is decoded with up to ``LEFT_CONTEXT_FRAMES`` frames
in front of it (a clone's reference codes count, as they do in the whole-row decode) and cut at its
first new frame, exactly on a frame boundary. Chunks ramp up from the first (two frames while the loop
is fast, more while it is busy: ``first_chunk_frames``) to ``CHUNK_CAP_FRAMES``. Why these numbers, and
the error against the whole-row decode at less context: docs/qwen.md, "Streaming";
``benchmarks/stream_context.py`` and ``benchmarks/streaming.py`` measure them.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from ttsq.engines.base import EngineOutput
from ttsq.errors import EngineError

if TYPE_CHECKING:
    from ttsq.engines.base import Piece
    from ttsq.engines.qwen.decode import DecodeLoop, Finished
    from ttsq.job import SynthesisRequest

logger = logging.getLogger(__name__)

#: Frames decoded in front of a chunk and thrown away: the 12 Hz decoder's attention window (its
#: ``sliding_window``), the receptive field vLLM-Omni settled on after 25 left audible joins.
LEFT_CONTEXT_FRAMES = 72
#: The first chunk of a row: two frames (160 ms of audio), handed over after the row's second step,
#: while the loop's frames are fast; more while they are slow (``first_chunk_frames``), up to
#: ``FIRST_CHUNK_MAX_FRAMES``. (One frame first gave a lone stream its audio a frame sooner, ~7 ms on
#: 2 CPU cores, but a burst's first rows, which took theirs before the others joined, ran dry.)
FIRST_CHUNK_FRAMES = 2
FIRST_CHUNK_MAX_FRAMES = 8
#: The audio of one frame (12.5 frames a second).
FRAME_S = 0.08
#: What a player's first chunk must cover beyond the frames of the second: the codec call and the way
#: to the reader (the job's task thread, Redis, a gateway), with a frame's jitter to spare.
HANDOVER_S = 0.06
#: Chunks double from the first up to this many frames (3.84 s of audio); each costs a decode of up to
#: ``LEFT_CONTEXT_FRAMES`` more frames than it keeps, so larger chunks waste less.
CHUNK_CAP_FRAMES = 48

Done = Callable[[EngineOutput | Exception], object]


def first_chunk_frames(frame_s: float) -> int:
    """The first chunk of a row in a loop whose frames take ``frame_s`` of wall time (recently, the
    admissions between them included): enough audio that a player who starts with it is still playing
    when the second chunk, twice as long, has been made and handed over (``HANDOVER_S``). The least
    while frames are fast (a lone stream); more in a busy loop, where the second chunk came after a
    short first one had played (benchmarks/streaming.py, 16 streams on 2 CPU cores)."""
    spare = FRAME_S - 2 * frame_s  # per frame of the first chunk: what it plays minus what the second costs
    if spare <= 0:
        return FIRST_CHUNK_MAX_FRAMES
    return max(FIRST_CHUNK_FRAMES, min(FIRST_CHUNK_MAX_FRAMES, math.ceil(HANDOVER_S / spare)))


def chunk_frames(index: int, first: int | None = None) -> int:
    """How many new frames the ``index``-th chunk of a row (0 = first) waits for, the first being
    ``first`` frames (``FIRST_CHUNK_FRAMES`` by default)."""
    return min((first or FIRST_CHUNK_FRAMES) << min(index, 16), CHUNK_CAP_FRAMES)


def schedule(frames: int, first: int | None = None) -> list[tuple[int, int]]:
    """The chunks ``[start, end)`` a streaming row of ``frames`` frames is decoded in: the ramp while
    it fits, then what is left when the row ends (the engine takes a chunk the frame it is complete)."""
    bounds: list[tuple[int, int]] = []
    start = 0
    while start < frames:
        end = min(start + chunk_frames(len(bounds), first), frames)
        bounds.append((start, end))
        start = end
    return bounds


def window(
    codes: Callable[[int, int], torch.Tensor],
    start: int,
    end: int,
    *,
    ref: torch.Tensor | None = None,
    context: int = LEFT_CONTEXT_FRAMES,
) -> tuple[torch.Tensor, int]:
    """Frames ``[start, end)`` of a row with up to ``context`` frames in front of them, and how many
    frames of context that is. ``codes(a, b)`` gives frames ``[a, b)`` of the row, ``(b - a, 16)``;
    ``ref`` (a clone's reference codes) stands in front of frame 0, as in the whole-row decode."""
    low = max(0, start - context)
    taken = codes(low, end)
    before = start - low
    if ref is not None and before < context and ref.shape[0] > 0:
        extra = ref[max(0, ref.shape[0] - (context - before)) :].to(taken.device)
        taken = torch.cat([extra, taken], dim=0)
        before += int(extra.shape[0])
    return taken, before


def frames_of(codes: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Frames ``[start, end)`` of a row's codes ``(frames, 16)``: ``window``'s source for a row at hand."""
    return codes[start:end]


def decode_windows(decoder: Any, windows: Sequence[tuple[torch.Tensor, int]]) -> list[npt.NDArray[np.float32]]:
    """Each window's audio from its first new frame on, in one decoder call for them all.

    ``decoder`` is the codec's ``Qwen3TTSTokenizerV2Decoder``. Windows are padded at their end to the
    longest (a causal decoder's earlier samples never hear the padding) and each is cut to its own new
    frames. The whole-row decode runs the same network through qwen-tts's ``chunked_decode``, which
    for rows of up to 300 frames is this one call."""
    per_frame = int(decoder.total_upsample)
    longest = max(int(codes.shape[0]) for codes, _ in windows)
    batch = torch.zeros(
        (len(windows), longest, int(windows[0][0].shape[1])), dtype=torch.long, device=windows[0][0].device
    )
    for row, (codes, _) in enumerate(windows):
        batch[row, : codes.shape[0]] = codes
    with torch.inference_mode():
        wav = decoder(batch.transpose(1, 2))[:, 0].to(torch.float32).cpu().numpy()
    return [
        np.ascontiguousarray(wav[row, before * per_frame : int(codes.shape[0]) * per_frame])
        for row, (codes, before) in enumerate(windows)
    ]


def stream_decode(
    decoder: Any, codes: torch.Tensor, *, ref: torch.Tensor | None = None, context: int = LEFT_CONTEXT_FRAMES
) -> list[npt.NDArray[np.float32]]:
    """The pieces qwen-fast hands over for a streaming row whose codes are ``codes`` ``(frames, 16)``:
    the same chunks, context and cuts, decoded one after another (for tests and benchmarks)."""
    return [
        decode_windows(decoder, [window(functools.partial(frames_of, codes), start, end, ref=ref, context=context)])[0]
        for start, end in schedule(int(codes.shape[0]))
    ]


@dataclass(eq=False)
class RowStream:
    """One streaming row: where its audio goes, what it has handed over, and how far its chunks are.

    The batcher thread schedules chunks; the codec thread decodes them and hands them over. ``lock``
    keeps a piece from being handed over once the row has been answered (``close``)."""

    piece: Piece
    done: Done
    request: SynthesisRequest
    cap: int
    ref: torch.Tensor | None
    #: Frames given to the codec so far, and in how many chunks; the first chunk's frames.
    scheduled: int = 0
    chunks: int = 0
    first: int = FIRST_CHUNK_FRAMES
    #: The samples handed over, in order: the row's output is exactly these, joined.
    handed: list[npt.NDArray[np.float32]] = field(default_factory=list)
    length: int = 0
    #: Set by the codec thread when a chunk failed and the row was answered with the error: the
    #: batcher thread then takes the row out of the loop.
    failed: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def due(self, made: int, frame_s: float = 0.0) -> bool:
        """Whether the next chunk is complete once the row has made ``made`` frames, in a loop whose
        frames take ``frame_s`` now. The first chunk's size is settled when it is taken, from the loop
        as the row's first frames found it (a burst's other rows joined by then)."""
        if self.chunks == 0:
            return made >= first_chunk_frames(frame_s)
        return made - self.scheduled >= chunk_frames(self.chunks, self.first)

    def take(self, end: int) -> tuple[int, int, bool]:
        """Schedule frames up to ``end``: the chunk's ``(start, end)`` and whether it is the first."""
        start, first = self.scheduled, self.chunks == 0
        if first:
            self.first = max(1, end)  # the ramp doubles from what the first chunk took
        self.scheduled, self.chunks = end, self.chunks + 1
        return start, end, first

    def hand(self, samples: npt.NDArray[np.float32], limit: int) -> bool:
        """Hand ``samples`` over (at most up to ``limit`` samples in all); False if the row was answered."""
        with self.lock:
            if self.closed:
                return False
            samples = samples[: max(0, limit - self.length)]
            if samples.size:
                self.handed.append(samples)
                self.length += samples.size
                self.piece(samples)
            return True

    def close(self) -> bool:
        """Take the row's answer: True for the one caller that must now call ``done``."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            return True


@dataclass
class Chunk:
    """Frames of one streaming row on their way to the codec."""

    stream: RowStream
    codes: torch.Tensor  # the window: ``context`` frames, then the new ones
    context: int
    first: bool
    #: The row's last chunk, and whether the row reached its cap without an end token.
    final: bool = False
    truncated: bool = False


def due_chunks(
    loop: DecodeLoop, streams: dict[int, RowStream], finished: list[Finished], frame_s: float = 0.0
) -> list[Chunk]:
    """The chunks due after a frame (batcher thread): the rest of every streaming row that finished
    with it (the row leaves ``streams``), and the next chunk of every streaming row still decoding
    whose chunk is now complete (``frame_s``: the loop's recent frame time, which sizes first chunks).
    Their codes are copies: a slot's buffer is reused once its row leaves."""
    chunks = []
    with torch.inference_mode():
        for row in finished:
            stream = streams.pop(row.slot, None)
            if stream is None:
                continue  # a whole row
            start, end, first = stream.take(int(row.codes.shape[0]))
            codes, context = window(functools.partial(frames_of, row.codes), start, end, ref=stream.ref)
            chunks.append(Chunk(stream, codes, context, first, final=True, truncated=row.truncated))
        for slot, stream in streams.items():
            made = loop.made(slot)
            if stream.due(made, frame_s):
                start, end, first = stream.take(made)
                codes, context = window(functools.partial(loop.codes, slot), start, end, ref=stream.ref)
                chunks.append(Chunk(stream, codes, context, first))
    return chunks


@dataclass(frozen=True)
class Handover:
    """The codec thread's half of streaming: decode chunks, hand each to its row's ``piece``, answer
    each row after its last chunk with exactly what it handed over (the frame cap, ``truncated`` and
    ``ignored`` as the whole-row path gives them; its pieces never pass the cap). Every chunk's row is
    answered whatever fails; a failed joint decode is retried chunk by chunk, so a bad chunk fails
    only its own row, at once (the batcher thread then takes the row out of the loop)."""

    #: The new samples of each chunk, in one decoder call (``decode_windows`` on the engine's codec).
    decode: Callable[[list[Chunk]], list[Any]]
    samples_per_frame: int
    sample_rate: int
    #: The checkpoint drops ``instruct`` (as the whole-row path reports in ``ignored``).
    ignores_instruct: bool

    def run(self, chunks: list[Chunk]) -> None:
        live = [chunk for chunk in chunks if not chunk.stream.closed]  # cancelled or failed rows decode nothing
        handled = 0
        try:
            new = [chunk for chunk in live if chunk.codes.shape[0] > chunk.context]
            results: dict[int, Any] = {id(chunk): np.zeros(0, dtype=np.float32) for chunk in live}
            if new:
                try:
                    results.update(zip(map(id, new), self.decode(new), strict=True))
                except Exception as exc:
                    if len(new) == 1:
                        results[id(new[0])] = exc
                    else:
                        logger.warning(
                            "codec decode of %d chunks failed (%s); decoding them one by one",
                            len(new),
                            type(exc).__name__,
                        )
                        for chunk in new:
                            try:
                                results[id(chunk)] = self.decode([chunk])[0]
                            except Exception as alone:
                                results[id(chunk)] = alone
            for chunk in live:
                handled += 1
                self._hand(chunk, results[id(chunk)])
        except BaseException as exc:
            logger.exception("codec decode of streaming chunks failed")
            for chunk in live[handled:]:
                self._hand(chunk, exc if isinstance(exc, Exception) else EngineError(repr(exc)))
            if not isinstance(exc, Exception):
                raise

    def _hand(self, chunk: Chunk, result: Any) -> None:
        stream = chunk.stream
        answer: EngineOutput | Exception
        if isinstance(result, Exception):
            stream.failed = True
            answer = EngineError(f"codec decode failed: {type(result).__name__}: {result}")
        else:
            try:
                if not stream.hand(np.asarray(result, dtype=np.float32), stream.cap * self.samples_per_frame):
                    return  # answered already (cancelled, or a failure it shared)
            except Exception as exc:  # the sink only enqueues; if even that fails, the row cannot stream
                stream.failed = True
                answer = EngineError(f"handing a streaming row its audio failed: {type(exc).__name__}: {exc}")
            else:
                if not chunk.final:
                    return
                answer = self._output(stream, chunk.truncated)
        if stream.close():
            try:
                stream.done(answer)
            except Exception:  # one job's bookkeeping must not keep the others from theirs
                logger.exception("a job's done callback failed")

    def _output(self, stream: RowStream, truncated: bool) -> EngineOutput | Exception:
        if stream.length == 0:
            return EngineError("the model ended before producing any audio")
        ignored = ("instruct",) if self.ignores_instruct and stream.request.instruct else ()
        return EngineOutput(np.concatenate(stream.handed), self.sample_rate, truncated=truncated, ignored=ignored)
