"""ttsq's own Qwen3-TTS decode loop: static caches, on-device sampling, slots that rows join and leave.

It runs the same modules of the same checkpoint as stock ``qwen-tts`` and replaces only the generation
loop; with greedy settings its codes equal stock's, token for token. This module is the loop itself
(slots, caches, CUDA graph capture); the layers it runs are in ``layers``, the per-row sampling in
``sampling``. What it changes against stock, and why: docs/qwen.md, "qwen-fast: ttsq's own decode loop".

Why one file over 400 lines: slots, caches and graph capture are one loop's state; split, each part
would reach into the others' tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from ttsq.engines.qwen.layers import CODE_GROUPS, SlotCache, decoder_layer, predictor_rope, rms, talker_rope
from ttsq.engines.qwen.sampling import MASK32, Sampling, SubSampling, sample, top, top_k_of, uniform


class _Captured(Exception):
    """Raised out of qwen-tts's generate once the talker's inputs are built."""

    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kwargs = kwargs


@dataclass
class Prompt:
    """One row's talker inputs, as stock qwen-tts builds them."""

    embeds: torch.Tensor  # (1, L, D) prompt embeddings
    trailing: torch.Tensor  # (1, Lt, D) text still to be fed, one position per frame
    pad: torch.Tensor  # (1, 1, D) what is fed once the text has run out
    #: Reference codes of a clone prompt (prepended before the codec decode, then cut off again).
    ref_code: torch.Tensor | None = None

    @staticmethod
    def capture(tts: Any, call: Any) -> Prompt:
        """Run one qwen-tts ``generate_*`` call until the talker would start generating, and keep the
        inputs it built: prompt embeddings, trailing text and pad embedding, for one row."""
        talker = tts.model.talker

        def stop(**kwargs: Any) -> Any:
            raise _Captured(kwargs)

        talker.generate = stop  # the instance attribute shadows GenerationMixin.generate for this call
        try:
            call()
        except _Captured as captured:
            kwargs = captured.kwargs
        else:
            raise RuntimeError("qwen-tts generated without calling the talker")
        finally:
            del talker.generate
        embeds = kwargs["inputs_embeds"]
        if embeds.shape[0] != 1:
            raise ValueError("capture one row at a time")
        return Prompt(embeds=embeds, trailing=kwargs["trailing_text_hidden"], pad=kwargs["tts_pad_embed"])


@dataclass
class Finished:
    """A row that left the loop: its codes, and whether it reached its cap without an end token."""

    slot: int
    codes: torch.Tensor  # (frames, 16), on the device
    truncated: bool
    tag: Any = None


@dataclass
class _Row:
    cap: int
    tag: Any
    prompt_length: int
    do_sample: bool
    top_k: int
    top_p: float
    frames: int = 0


class DecodeLoop:
    """A fixed set of slots decoding one Qwen3-TTS checkpoint frame by frame. One thread owns it."""

    def __init__(
        self,
        model: Any,
        *,
        slots: int,
        positions: int,
        max_frames: int,
        sub: SubSampling,
        graphs: bool = False,
        static: bool | None = None,
    ) -> None:
        self.model = model
        self.talker = model.talker
        self.predictor = model.talker.code_predictor
        config = model.config.talker_config
        self.eos = int(config.codec_eos_token_id)
        self.vocab = int(config.vocab_size)
        self.slots = slots
        self.positions = positions
        self.max_frames = max_frames
        self.sub = sub
        parameter = next(self.talker.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        device, dtype = self.device, self.dtype

        def cache(layers: Any, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            attention = layers[0].self_attn
            heads = attention.config.num_key_value_heads
            shape = (slots, heads, length, attention.head_dim)
            return (
                [torch.zeros(shape, device=device, dtype=dtype) for _ in layers],
                [torch.zeros(shape, device=device, dtype=dtype) for _ in layers],
            )

        self._talker_cache = SlotCache(*cache(self.talker.model.layers, positions))
        self._predictor_cache = SlotCache(*cache(self.predictor.model.layers, CODE_GROUPS))
        hidden = int(config.hidden_size)
        ids = dict(device=device, dtype=torch.long)
        # Per-slot state; a free slot keeps stepping on stale values (its results are never read).
        self._position = torch.zeros(slots, **ids)  # where the row's next key goes (= its position)
        self._step = torch.zeros(slots, **ids)  # frames made so far (generation_step in qwen-tts)
        self._token = torch.zeros(slots, **ids)  # the talker code of the frame to make next
        self._hidden = torch.zeros(slots, 1, hidden, device=device, dtype=dtype)  # talker's last hidden
        self._trailing = torch.zeros(slots, positions, hidden, device=device, dtype=dtype)
        self._seen = torch.zeros(slots, self.vocab, device=device, dtype=torch.bool)  # repetition penalty
        self._codes = torch.zeros(slots, max_frames + 1, CODE_GROUPS, **ids)
        self._do_sample = torch.zeros(slots, device=device, dtype=torch.bool)
        self._temperature = torch.ones(slots, device=device, dtype=torch.float32)
        self._top_k = torch.ones(slots, **ids)
        self._top_p = torch.ones(slots, device=device, dtype=torch.float32)
        self._penalty = torch.ones(slots, device=device, dtype=torch.float32)
        self._seed = torch.zeros(slots, **ids)
        self._slot_index = torch.arange(slots, **ids)
        self._marks = torch.ones(slots, device=device, dtype=torch.bool)
        self._key_index = torch.arange(positions, **ids)
        self._sub_temperature = torch.full((slots,), sub.temperature, device=device)
        self._sub_top_k = torch.full((slots,), top_k_of(sub.top_k, self.vocab), **ids)
        self._sub_top_p = torch.full((slots,), sub.top_p, device=device)
        self._suppress = torch.zeros(self.vocab, device=device, dtype=torch.bool)
        self._suppress[self.vocab - 1024 :] = True  # codec control ids, as qwen-tts suppresses them
        self._suppress[self.eos] = False
        self._talker_rope = talker_rope(self.talker.model.rotary_emb, config.rope_scaling, positions, dtype, device)
        self._predictor_rope = predictor_rope(self.predictor.model.rotary_emb, dtype, device)
        self._rows: dict[int, _Row] = {}
        self._graphs: dict[tuple[int, int], Any] = {}
        self._pool: Any = None
        self._use_graphs = graphs and self.device.type == "cuda"
        # Bucketed shapes (rows and cache length rounded up, fixed sampling widths) are what a graph
        # records; ``static=True`` runs them uncaptured, so a CPU can prove them exact too.
        self._static = self._use_graphs if static is None else static

    # -- admission --------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return len(self._rows)

    def free_slots(self) -> int:
        return self.slots - len(self._rows)

    def fits(self, prompt: Prompt, cap: int) -> bool:
        """Whether a prompt and its frames fit a slot's cache."""
        return (
            prompt.embeds.shape[1] + cap + 1 <= self.positions
            and prompt.trailing.shape[1] < self.positions
            and cap <= self.max_frames
        )

    def admit(self, prompt: Prompt, *, cap: int, sampling: Sampling, tag: Any = None) -> int:
        """Prefill one row into the lowest free slot; it decodes from the next ``step`` on."""
        with torch.inference_mode():
            return self._admit(prompt, cap, sampling, tag)

    def _admit(self, prompt: Prompt, cap: int, sampling: Sampling, tag: Any) -> int:
        if not self.fits(prompt, cap):
            raise ValueError(
                f"a prompt of {prompt.embeds.shape[1]} positions with {cap} frames does not fit "
                f"a slot of {self.positions} positions"
            )
        slot = next(index for index in range(self.slots) if index not in self._rows)
        length = prompt.embeds.shape[1]
        # Prefill exactly as stock qwen-tts does for a batch of one: the talker's own forward, with
        # its own mask and rope index, into a fresh dynamic cache.
        out = self.talker(
            inputs_embeds=prompt.embeds,
            attention_mask=torch.ones(1, length, dtype=torch.long, device=self.device),
            past_key_values=DynamicCache(),
            use_cache=True,
            cache_position=torch.arange(length, device=self.device),
            trailing_text_hidden=prompt.trailing,
            tts_pad_embed=prompt.pad,
        )
        for layer, cached in enumerate(out.past_key_values.layers):
            self._talker_cache.keys[layer][slot, :, :length] = cached.keys[0]
            self._talker_cache.values[layer][slot, :, :length] = cached.values[0]
        trailing = prompt.trailing.shape[1]
        self._trailing[slot, :trailing] = prompt.trailing[0]
        self._trailing[slot, trailing:] = prompt.pad[0, 0]
        self._hidden[slot] = out.past_hidden[0]
        self._position[slot] = length
        self._step[slot] = 0
        self._seen[slot] = False
        self._do_sample[slot] = sampling.do_sample
        self._temperature[slot] = sampling.temperature
        top_k = top_k_of(sampling.top_k, self.vocab)
        self._top_k[slot] = top_k
        self._top_p[slot] = sampling.top_p
        self._penalty[slot] = sampling.repetition_penalty
        self._seed[slot] = sampling.seed & MASK32
        self._rows[slot] = _Row(
            cap=cap, tag=tag, prompt_length=length, do_sample=sampling.do_sample, top_k=top_k, top_p=sampling.top_p
        )
        try:  # the row is in (``_choose`` reads its settings); if its first code fails, it must not stay
            rows = self._slot_index[slot : slot + 1]
            token = self._choose(out.logits[:, -1], rows, generated=0)
            self._token[slot] = token[0]
            self._seen[slot, token[0]] = True
        except BaseException:
            del self._rows[slot]
            raise
        return slot

    def cancel(self, slot: int) -> None:
        """Free a slot without finishing its row."""
        self._rows.pop(slot, None)

    def made(self, slot: int) -> int:
        """How many frames the row decoding in ``slot`` has made so far."""
        return self._rows[slot].frames

    def codes(self, slot: int, start: int, end: int) -> torch.Tensor:
        """A copy of frames ``[start, end)`` of the row decoding in ``slot``, ``(end - start, 16)``: a
        streaming row's codes while it still decodes (the slot's buffer is reused once it leaves)."""
        return self._codes[slot, start:end].clone()

    # -- decoding ---------------------------------------------------------------------------------

    def step(self) -> list[Finished]:
        """One frame for every row; returns the rows that finished with it."""
        if not self._rows:
            return []
        with torch.inference_mode():
            return self._step_rows()

    def _step_rows(self) -> list[Finished]:
        rows = max(self._rows) + 1
        length = max(self._rows[slot].prompt_length + self._rows[slot].frames for slot in self._rows) + 1
        if self._static:
            rows = next(size for size in _powers(self.slots, 1) if size >= rows)
            length = next(size for size in _powers(self.positions, 128) if size >= length)
        graph = self._graphs.get((rows, length))
        if graph is None:
            self._frame(rows, length)
        else:
            graph.replay()
        tokens = self._token[:rows].tolist()  # the one host sync per frame
        finished = []
        for slot in sorted(self._rows):
            row = self._rows[slot]
            row.frames += 1
            ended = tokens[slot] == self.eos
            if ended or row.frames >= row.cap:
                del self._rows[slot]
                finished.append(
                    Finished(
                        slot, self._codes[slot, : row.frames].clone(), truncated=row.frames >= row.cap, tag=row.tag
                    )
                )
        return finished

    def capture(self, rows: int, length: int) -> None:
        """Record one frame for (rows, length) as a CUDA graph; a CPU has none and runs uncaptured."""
        if not self._use_graphs or (rows, length) in self._graphs:
            return
        saved = self._state()
        if self._pool is None:  # the first capture: warm kernels, workspaces and the allocator outside a graph
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.inference_mode(), torch.cuda.stream(stream):
                for _ in range(2):
                    self._frame(rows, length)
            torch.cuda.current_stream().wait_stream(stream)
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Every bucket's graph shares one memory pool: they are only ever replayed one at a time.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            self._frame(rows, length)
        self._restore(saved)
        self._graphs[(rows, length)] = graph

    def buckets(self) -> list[tuple[int, int]]:
        """The (rows, length) shapes a CUDA loop captures: rows in powers of two up to the slots,
        cache lengths in powers of two from 128 up to the positions."""
        return [(rows, length) for rows in _powers(self.slots, 1) for length in _powers(self.positions, 128)]

    def _state(self) -> list[torch.Tensor]:
        return [
            tensor.clone()
            for tensor in (self._position, self._step, self._token, self._hidden, self._seen, self._codes)
        ]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(
            (self._position, self._step, self._token, self._hidden, self._seen, self._codes), saved, strict=True
        ):
            tensor.copy_(value)

    def _frame(self, rows: int, length: int) -> None:
        """One frame for slots ``[:rows]``, attending over cache positions ``[:length]``: the code
        predictor's 15 codes, then the talker step that yields the next frame's first code.

        Static shapes and no host syncs: this is what a CUDA graph records.
        """
        slots = self._slot_index[:rows]
        step = self._step[:rows]
        token = self._token[:rows]
        first = self.talker.get_input_embeddings()(token[:, None])  # (rows, 1, D)
        codes = self._predict(torch.cat((self._hidden[:rows], first), dim=1), slots, step)  # (rows, 15)
        frame = torch.cat((token[:, None], codes), dim=1)
        self._codes[slots, step.clamp(max=self.max_frames)] = frame
        # The talker's next input, summed as qwen-tts sums it (same order, same reduction).
        embedded = [first] + [
            self.predictor.get_input_embeddings()[i](codes[:, i : i + 1]) for i in range(CODE_GROUPS - 1)
        ]
        inputs = torch.cat(embedded, dim=1).sum(1, keepdim=True)
        inputs = inputs + self._trailing[slots, step.clamp(max=self.positions - 1)].unsqueeze(1)
        hidden = self._talker_forward(inputs, slots, length)
        logits = self.talker.codec_head(hidden)
        self._hidden[:rows] = hidden
        generated = step + 1
        following = self._choose(logits[:, -1], slots, generated=generated)
        self._token[:rows] = following
        # A device tensor, not a Python True: nothing in a captured frame may copy from the host.
        self._seen.index_put_((slots, following), self._marks[:rows])
        self._step[:rows] = generated.clamp(max=self.max_frames)
        self._position[:rows] = (self._position[:rows] + 1).clamp(max=self.positions - 1)

    def _talker_forward(self, inputs: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
        rows = inputs.shape[0]
        position = self._position[:rows]
        cache = self._talker_cache
        cache.rows, cache.length, cache.write_at = rows, length, None
        cache.write_rows, cache.write_positions = slots, position
        cos, sin = (table[position].view(rows, 1, 1, -1) for table in self._talker_rope)
        mask = self._key_index[:length].view(1, 1, 1, length) <= position.view(rows, 1, 1, 1)
        hidden = inputs
        for index, layer in enumerate(self.talker.model.layers):
            hidden = decoder_layer(layer, index, hidden, cos, sin, cache, mask)
        return rms(hidden, self.talker.model.norm)

    def _predict(self, inputs: torch.Tensor, slots: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """The code predictor's 15 codes for each row: one 2-position prefill, then 14 single steps,
        into the static 16-position cache (every row is at the same position)."""
        rows = inputs.shape[0]
        predictor = self.predictor
        model = predictor.model
        cache = self._predictor_cache
        cache.rows, cache.write_rows, cache.write_positions = rows, None, None
        codes = []
        hidden = predictor.small_to_mtp_projection(inputs)
        race = self._sub_race(slots, step)
        start = 0
        for group in range(CODE_GROUPS - 1):
            width = hidden.shape[1]
            cache.write_at, cache.length = start, start + width
            cos, sin = (table[:, :, start : start + width] for table in self._predictor_rope)
            for index, layer in enumerate(model.layers):
                hidden = decoder_layer(layer, index, hidden, cos, sin, cache, None)
            head = predictor.lm_head[group]
            logits = F.linear(rms(hidden, model.norm), head.weight)[:, -1]
            code = self._sub_choose(logits, slots, step, group + 1, race)
            codes.append(code)
            start += width
            if group < CODE_GROUPS - 2:
                embedded = F.embedding(code[:, None], model.codec_embedding[group].weight)
                hidden = predictor.small_to_mtp_projection(embedded)
        return torch.stack(codes, dim=1)

    # -- sampling ---------------------------------------------------------------------------------

    def _choose(self, logits: torch.Tensor, slots: torch.Tensor, *, generated: torch.Tensor | int) -> torch.Tensor:
        """The talker's code for each row, with qwen-tts's logits processors: repetition penalty over
        the codes the row has generated, no end token before the second code, control ids suppressed;
        then greedy, or temperature, top-k, top-p and a seeded draw."""
        scores = logits.float()
        penalty = self._penalty[slots].unsqueeze(1)
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(self._seen[slots], penalised, scores)
        generated_t = torch.as_tensor(generated, device=self.device).expand(scores.shape[0])
        early = (generated_t < 2).unsqueeze(1) & (torch.arange(self.vocab, device=self.device) == self.eos)
        scores = scores.masked_fill(early | self._suppress, -math.inf)
        greedy = scores.argmax(dim=-1)
        widest = self._widest()
        if widest == 0:  # every row is greedy (known on the host; a captured frame always samples)
            return greedy
        nucleus = self._static or any(row.top_p < 1.0 for row in self._rows.values() if row.do_sample)
        drawn = sample(
            scores,
            self._temperature[slots],
            self._top_k[slots],
            self._top_p[slots],
            self._seed[slots],
            generated_t * CODE_GROUPS,
            widest,
            nucleus=nucleus,
        )
        return torch.where(self._do_sample[slots], drawn, greedy)

    def _sub_race(self, slots: torch.Tensor, step: torch.Tensor) -> torch.Tensor | None:
        """The log of the exponential noise for a frame's 15 sub-talker draws, (rows, 15, top-k), in one
        hash: keyed by (seed, frame, codebook, rank among the top-k), so a row still draws the same
        numbers whatever else is in its batch. One hash per frame instead of fifteen small ones."""
        sub = self.sub
        if not sub.do_sample or sub.top_p < 1.0:
            return None  # greedy, or the nucleus path (``sample``), which keys its noise by code
        widest = top_k_of(sub.top_k, self.predictor.config.vocab_size)
        groups = torch.arange(1, CODE_GROUPS, device=self.device)
        counter = (step.unsqueeze(1) * CODE_GROUPS + groups).reshape(-1)  # (rows * 15,)
        seed = self._seed[slots].unsqueeze(1).expand(-1, CODE_GROUPS - 1).reshape(-1)  # no host sync on CUDA
        rank = torch.arange(widest, device=self.device).expand(counter.shape[0], widest)
        return torch.log(-torch.log(uniform(seed, counter, rank))).view(-1, CODE_GROUPS - 1, widest)

    def _sub_choose(
        self,
        logits: torch.Tensor,
        slots: torch.Tensor,
        step: torch.Tensor,
        group: int,
        race: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scores = logits.float()
        if not self.sub.do_sample:
            return scores.argmax(dim=-1)
        if race is not None:
            # Top-k then an exponential race over the candidates in rank order: argmax of p / E is
            # argmax of logit / T - log E (softmax's shift and scale change no order).
            values, candidates = top(scores, race.shape[-1])
            chosen = (values / self.sub.temperature - race[:, group - 1]).argmax(dim=-1, keepdim=True)
            return candidates.gather(1, chosen).squeeze(1)
        rows = scores.shape[0]
        widest = top_k_of(self.sub.top_k, scores.shape[-1])
        return sample(
            scores,
            self._sub_temperature[:rows],
            self._sub_top_k[:rows],
            self._sub_top_p[:rows],
            self._seed[slots],
            step * CODE_GROUPS + group,
            widest,
            nucleus=self.sub.top_p < 1.0,
            ragged=False,
        )

    def _widest(self) -> int:
        """How many candidates the talker's sampling sorts: every sampling row's top-k fits."""
        if self._static:  # every code: a checkpoint's default top_k may be 0 (no top-k), more than a request's 1000
            return self.vocab
        return max((row.top_k for row in self._rows.values() if row.do_sample), default=0)


def _powers(limit: int, smallest: int) -> list[int]:
    """Powers of two from ``smallest`` below ``limit``, then ``limit`` itself."""
    values = [1 << i for i in range(limit.bit_length()) if smallest <= (1 << i) < limit]
    return [*values, limit]
