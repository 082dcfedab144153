"""What ``ttsq bench`` sends: the built-in corpus (or one read from a file), the plan of a run, and
the request of every job in it (each one cache-busting unless the run times cache hits)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ttsq.errors import InvalidRequest
from ttsq.job import Limits, SynthesisRequest

BenchMode = Literal["synthesize", "cache-hit"]


MODES: tuple[BenchMode, ...] = ("synthesize", "cache-hit")


@dataclass(frozen=True)
class Sentence:
    """One corpus entry: text, its language, its size class, and any other request fields."""

    text: str
    language: str = "auto"
    size: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)


def _mix(language: str, short: str, medium: str, long: str) -> tuple[Sentence, ...]:
    return (Sentence(short, language, "short"), Sentence(medium, language, "medium"), Sentence(long, language, "long"))


#: The built-in mix: a short, a medium and a long sentence in each of seven languages.
CORPUS: tuple[Sentence, ...] = (
    *_mix(
        "english",
        "Hello, and welcome.",
        "The train to the airport leaves every twenty minutes from the second platform.",
        "When the storm finally passed, the villagers walked down to the harbour to count the boats, and to "
        "their surprise every one of them was still there, rocking gently against the old stone wall as if "
        "nothing had happened at all.",
    ),
    *_mix(
        "korean",
        "안녕하세요, 반갑습니다.",
        "오늘 오후에는 전국적으로 비가 내리고 저녁부터 기온이 크게 떨어지겠습니다.",
        "지난주에 새로 문을 연 동네 도서관은 주말마다 어린이를 위한 그림책 읽기 모임을 열고 있는데, 부모들 사이에서 "
        "입소문이 나면서 벌써 다음 달 예약까지 모두 찼다고 합니다.",
    ),
    *_mix(
        "japanese",
        "おはようございます。",
        "次の電車は十時十五分に三番線から発車します。",
        "週末に友人と山へ出かけたのですが、頂上に着く頃には霧がすっかり晴れて、遠くの海まで見渡すことができ、"
        "持ってきたおにぎりがいつもよりずっと美味しく感じられました。",
    ),
    *_mix(
        "chinese",
        "你好，欢迎光临。",
        "明天上午九点，我们会在三楼会议室讨论新的项目计划。",
        "这家小餐馆开了二十多年，老板每天清晨五点就开始准备食材，所以无论什么时候来，客人总能吃到新鲜又热乎的饭菜，"
        "这也是街坊们一直愿意光顾的原因。",
    ),
    *_mix(
        "german",
        "Guten Morgen!",
        "Der Zug nach München hat heute leider etwa zwanzig Minuten Verspätung.",
        "Als wir am Abend endlich die Hütte erreichten, war das Feuer schon angezündet, und der Wirt stellte "
        "uns ohne ein Wort zwei dampfende Teller Suppe auf den Tisch, die nach einem langen Tag im Schnee "
        "besser schmeckte als jedes Festessen.",
    ),
    *_mix(
        "french",
        "Bonjour à tous.",
        "La bibliothèque municipale sera fermée lundi prochain pour des travaux.",
        "Chaque été, ma grand-mère préparait des confitures avec les abricots du jardin, et toute la maison "
        "sentait le sucre chaud pendant des jours, si bien que les voisins passaient toujours nous rendre "
        "visite à ce moment-là.",
    ),
    *_mix(
        "spanish",
        "¡Buenos días!",
        "El museo abre sus puertas a las diez de la mañana, de martes a domingo.",
        "Cuando llegamos al pueblo ya era de noche, pero la plaza seguía llena de gente que bailaba al ritmo "
        "de una pequeña orquesta, y un señor muy amable nos invitó a sentarnos con su familia a compartir la "
        "cena.",
    ),
)


def load_corpus(path: Path) -> list[Sentence]:
    """A corpus file, one entry per line: plain text, ``LANGUAGE<TAB>text``, or a JSON object of
    request fields (``{"text": ..., "language": ..., "instruct": ...}``). Blank lines and lines
    starting with ``#`` are skipped."""
    sentences = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest("corpus", f"line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict) or not isinstance(data.get("text"), str):
                raise InvalidRequest("corpus", f'line {number}: a JSON line needs a "text" string')
            extra = {k: v for k, v in data.items() if k not in ("text", "language")}
            sentences.append(Sentence(data["text"], str(data.get("language", "auto")), fields=extra))
        elif "\t" in line:
            language, text = line.split("\t", 1)
            sentences.append(Sentence(text.strip(), language.strip()))
        else:
            sentences.append(Sentence(line))
    if not sentences:
        raise InvalidRequest("corpus", f"{path} holds no sentences")
    return sentences


# Zero-width characters (format characters, not whitespace: normalization keeps them). Put before the
# text they change its content key but not what espeak-ng says; after the text espeak adds a pause.
_MARKER_SYMBOLS = ("\u200b", "\u200c", "\u200d", "\u2060")


_MARKER_LENGTH = 20  # 40 bits: two jobs of one run share a key with odds below 1e-4 at 10^4 jobs


def bust_marker(run_id: str, index: int) -> str:
    """An invisible prefix unique to one job of one run, so the job misses the cache."""
    value = int.from_bytes(hashlib.sha256(f"{run_id}:{index}".encode()).digest()[:8], "big")
    return "".join(_MARKER_SYMBOLS[(value >> (2 * i)) & 3] for i in range(_MARKER_LENGTH))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to run: how many jobs, how they arrive, which path they take."""

    jobs: int
    #: Closed loop: jobs in flight at once. Ignored when ``rate`` is set.
    concurrency: int = 16
    #: Open loop: mean arrivals per second (Poisson). None for a closed loop.
    rate: float | None = None
    mode: BenchMode = "synthesize"
    timeout_s: float = 300.0
    seed: int = 0
    #: Open loop: most jobs in flight; past it arrivals wait for a sender (and that wait counts).
    max_in_flight: int = 256
    audio_format: str = "wav"
    #: Untimed jobs sent first (cache misses), so connections and first calls are paid before timing.
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise InvalidRequest("jobs", "must be at least 1")
        if self.concurrency < 1:
            raise InvalidRequest("concurrency", "must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise InvalidRequest("rate", "must be above 0 jobs/s")
        if self.mode not in MODES:
            raise InvalidRequest("mode", f"expected one of {', '.join(MODES)}")
        if self.timeout_s <= 0:
            raise InvalidRequest("timeout", "must be above 0")
        if self.max_in_flight < 1:
            raise InvalidRequest("max_in_flight", "must be at least 1")
        if self.warmup < 0:
            raise InvalidRequest("warmup", "must be 0 or more")


def make_requests(
    corpus: Sequence[Sentence], count: int, *, mode: BenchMode, run_id: str, seed: int, audio_format: str
) -> list[dict[str, Any]]:
    """``count`` request dicts cycling through the corpus in a shuffled order.

    In ``synthesize`` mode each text carries a marker unique to (run, position): a miss.
    """
    rng = random.Random(seed)
    order: list[Sentence] = []
    while len(order) < count:
        cycle = list(corpus)
        rng.shuffle(cycle)
        order.extend(cycle)
    requests = []
    for position, sentence in enumerate(order[:count]):
        text = sentence.text if mode == "cache-hit" else bust_marker(run_id, position) + sentence.text
        requests.append(_fields(sentence, text, audio_format))
    return requests


def _fields(sentence: Sentence, text: str, audio_format: str) -> dict[str, Any]:
    return {"format": audio_format, **sentence.fields, "text": text, "language": sentence.language}


def check_corpus(corpus: Sequence[Sentence], plan: Plan, limits: Limits) -> None:
    """Refuse a corpus with a request the producer would refuse, before anything starts."""
    if not corpus:
        raise InvalidRequest("corpus", "is empty")
    for number, sentence in enumerate(corpus, 1):
        try:
            SynthesisRequest.from_dict(_fields(sentence, sentence.text, plan.audio_format), limits)
        except InvalidRequest as exc:
            raise InvalidRequest("corpus", f"entry {number}: {exc}") from None
