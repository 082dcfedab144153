"""A long multilingual document for the document tests and ``benchmarks/document.py``."""

from __future__ import annotations

#: A sentence in each of the ten languages Qwen3-TTS speaks; ``{n}`` keeps every chunk distinct.
SENTENCES = (
    "Dr. Smith measured 3.5 litres of water in sample {n}, i.e. more than expected.",
    "Der Versuch Nummer {n} begann um 9.30 Uhr, z.B. mit einer kurzen Messung.",
    "Le chapitre {n} raconte « une longue histoire » sur la mer et les bateaux.",
    "El capítulo {n} habla de la ciudad (y de su gente) durante el invierno.",
    "Il capitolo {n} descrive una giornata di sole a Roma, con molte persone.",
    "O capítulo {n} fala de um rio comprido que atravessa o país inteiro.",
    "Глава {n} рассказывает о зиме в Москве и о длинных вечерах.",
    "第{n}章讲述了一个关于大海的故事。渔夫每天早上出海！",
    "第{n}章は海の話です。漁師は毎朝早く海に出ます。",
    "제{n}장은 바다에 관한 이야기입니다. 어부는 매일 아침 바다로 나갑니다.",
)


#: One sentence longer than TTSQ_DOC_MAX_CHARS (400): it is cut at its commas and crossfaded.
RUN_ON = ", ".join(f"and then the road turned again past the {n}th old mill by the river" for n in range(12)) + "."


def corpus(chars: int) -> str:
    """A multilingual document of about ``chars`` characters, in paragraphs of five sentences."""
    paragraphs, sentences, n = [RUN_ON], [], 0
    while sum(map(len, paragraphs)) + sum(map(len, sentences)) < chars:
        sentences.append(SENTENCES[n % len(SENTENCES)].format(n=n))
        n += 1
        if len(sentences) == 5:
            paragraphs.append(" ".join(sentences))
            sentences = []
    if sentences:
        paragraphs.append(" ".join(sentences))
    return "\n\n".join(paragraphs)
