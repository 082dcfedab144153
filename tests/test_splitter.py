"""The document splitter: no character lost or doubled, in every script; the hard cases by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ttsq.splitter import Chunk, normalize, split


def sentences(text: str, max_chars: int = 400) -> list[str]:
    """Each sentence (or cut piece) of ``text`` alone: a target of one character packs nothing."""
    return [chunk.text for chunk in split(text, target_chars=1, max_chars=max_chars)]


# --- the property: chunks join back to the normalized input --------------------------------------


def _script(alphabet: str, *, spaced: bool, word: int = 12) -> st.SearchStrategy[str]:
    """Text in one script: words of its letters, with its punctuation, quotes, brackets, numbers and
    every kind of whitespace between them (spaceless scripts get no spaces between words)."""
    words = st.text(alphabet=alphabet, min_size=1, max_size=word)
    marks = st.sampled_from(
        [
            ". ",
            "! ",
            "? ",
            ", ",
            "; ",
            ": ",
            "... ",
            "。",
            "！",
            "？",
            "，",
            "、",
            "．",
            '"',
            "'",
            "«",
            "»",
            "“",
            "”",
            "「",
            "」",
            "(",
            ")",
            "[",
            "]",
            "（",
            "）",
            "Dr. ",
            "e.g. ",
            "i.e. ",
            "J. ",
            "3.14",
            "２．５",
            "—",
            " - ",
            " » ",
            "„",
            "と",
        ]
    )
    spaces = st.sampled_from([" ", "  ", "\t", "\n", "\n\n", " \n \n ", "\r\n\r\n", "\u00a0", "\u2029", "\u3000"])
    separator = spaces if spaced else st.one_of(st.just(""), spaces)
    token = st.one_of(st.tuples(words, separator).map("".join), marks, spaces)
    return st.lists(token, max_size=120).map("".join)


LATIN = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZàéèüöäßñçõãìò0123456789"
SCRIPTS = {
    "latin": _script(LATIN, spaced=True),
    "cyrillic": _script("абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЖЗИЙКЛМН", spaced=True),
    "han": _script(
        "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心",
        spaced=False,
        word=60,
    ),
    "kana": _script(
        "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをん"
        "アイウエオカキクケコ",
        spaced=False,
        word=60,
    ),
    "hangul": _script("가나다라마바사아자차카타파하한국어안녕하세요감사합니다", spaced=True),
    "mixed": _script(LATIN + "абвгд的一是不了あいうえおアイウ가나다라", spaced=False, word=30),
    "any": st.text(max_size=400),
}


def check_chunks(text: str, chunks: list[Chunk], max_chars: int) -> None:
    normalized = normalize(text)
    assert "".join(chunk.raw for chunk in chunks) == normalized  # nothing lost, nothing doubled
    assert normalize(normalized) == normalized  # normalizing twice changes nothing
    position = 0
    for index, chunk in enumerate(chunks):
        assert chunk.start == position and normalized[chunk.start : chunk.end] == chunk.raw
        position = chunk.end
        assert chunk.text and chunk.text == chunk.raw.strip() and len(chunk.text) <= max_chars
        assert "\n\n" not in chunk.text  # a chunk never spans a paragraph break
        assert (chunk.boundary == "end") == (index == len(chunks) - 1)
        assert (chunk.boundary == "paragraph") == chunk.raw.endswith("\n\n")
        assert chunk.sentences and chunk.sentences[0].start == chunk.start
        assert chunk.sentences[-1].end == chunk.start + len(chunk.text)
        for sentence in chunk.sentences:
            assert chunk.start <= sentence.start < sentence.end <= chunk.end
            assert normalized[sentence.start : sentence.end].strip() == normalized[sentence.start : sentence.end]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_chunks_join_back_to_the_normalized_input(script: str) -> None:
    @settings(max_examples=150, deadline=None)
    @given(text=SCRIPTS[script], target=st.integers(1, 120), extra=st.integers(0, 80))
    def prop(text: str, target: int, extra: int) -> None:
        max_chars = max(20, target + extra)
        check_chunks(text, split(text, target_chars=min(target, max_chars), max_chars=max_chars), max_chars)

    prop()


@settings(max_examples=150, deadline=None)
@given(
    words=st.lists(st.text(alphabet=LATIN, min_size=1, max_size=19), min_size=1, max_size=80),
    max_chars=st.integers(20, 60),
)
def test_latin_words_are_never_cut_when_each_fits(words: list[str], max_chars: int) -> None:
    text = " ".join(words)
    chunks = split(text, target_chars=max_chars, max_chars=max_chars)
    check_chunks(text, chunks, max_chars)
    assert all(chunk.raw.endswith(" ") for chunk in chunks[:-1])  # every cut is at a space


# --- the hard cases -------------------------------------------------------------------------------


def test_normalized_input_keeps_paragraphs_and_folds_other_whitespace() -> None:
    assert normalize("  One\ttwo\nthree \r\n\r\n\n Four\u00a0five \u2029 six  ") == "One two three\n\nFour five\n\nsix"
    assert normalize("e\u0301") == "é"  # NFC


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Dr. Smith went home. He slept.", ["Dr. Smith went home.", "He slept."]),
        ("Bring fruit, e.g. apples and pears. Then go.", ["Bring fruit, e.g. apples and pears.", "Then go."]),
        ("That is, i.e. the point. Fine.", ["That is, i.e. the point.", "Fine."]),
        ("It costs 3.14 dollars. Version 2.0 is out.", ["It costs 3.14 dollars.", "Version 2.0 is out."]),
        ("J. R. R. Tolkien wrote books. Yes.", ["J. R. R. Tolkien wrote books.", "Yes."]),
        ("About approx. five people came. Then more.", ["About approx. five people came.", "Then more."]),
        ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
        ("(This is one.) This is two.", ["(This is one.)", "This is two."]),
        ("Really?! Yes... Wait... What happened?", ["Really?!", "Yes...", "Wait...", "What happened?"]),
        ("Der Zug kam z.B. um 9.30 Uhr an. Gut.", ["Der Zug kam z.B. um 9.30 Uhr an.", "Gut."]),
        ("Привет. Как дела? Хорошо!", ["Привет.", "Как дела?", "Хорошо!"]),
        ("你好。我是学生！你呢？", ["你好。", "我是学生！", "你呢？"]),
        ("价格是３．５元。下一句。", ["价格是３．５元。", "下一句。"]),
        (
            "「こんにちは。」と彼は言った。元気ですか？",
            ["「こんにちは。」と彼は言った。", "元気ですか？"],
        ),  # quotative と
        ("「はい。」そうです。", ["「はい。」", "そうです。"]),
        (
            "Er sagte: „Hallo.“ Dann ging er. Sie rief: „Warte!“ Niemand kam.",
            ["Er sagte: „Hallo.“", "Dann ging er.", "Sie rief: „Warte!“", "Niemand kam."],
        ),
        ("Er kam. »Hallo.« Dann ging er.", ["Er kam.", "»Hallo.«", "Dann ging er."]),
        (
            "Il a dit : « Bonjour. » Puis il est parti. « Quoi ? » demanda-t-elle. Oui.",
            ["Il a dit : « Bonjour. »", "Puis il est parti.", "« Quoi ? » demanda-t-elle.", "Oui."],
        ),
        (
            "Das ist Nr. 5 der Liste. Il Sig. Rossi è arrivato. Он живёт на ул. Ленина. Bom.",
            ["Das ist Nr. 5 der Liste.", "Il Sig. Rossi è arrivato.", "Он живёт на ул. Ленина.", "Bom."],
        ),
        ("¿Qué hora es? ¡Son las tres! Vale.", ["¿Qué hora es?", "¡Son las tres!", "Vale."]),
        (
            "나는 학생이다.그는 선생님이다.우리는 친구다. 좋다.",
            ["나는 학생이다.", "그는 선생님이다.", "우리는 친구다.", "좋다."],
        ),
        ("你好!我是学生?是的.", ["你好!", "我是学生?", "是的."]),
        ("我想……也许吧。我想...也许吧。", ["我想……也许吧。", "我想...也许吧。"]),
        (
            "Visit https://example.com/a.b?c=d. Mail john.doe@example.org. It weighs 1,000.5 kg.",
            ["Visit https://example.com/a.b?c=d.", "Mail john.doe@example.org.", "It weighs 1,000.5 kg."],
        ),
        ("안녕하세요. 반갑습니다! 저는 학생입니다.", ["안녕하세요.", "반갑습니다!", "저는 학생입니다."]),
        ("English first. 然后是中文。Then English again.", ["English first.", "然后是中文。", "Then English again."]),
    ],
)
def test_sentence_ends(text: str, expected: list[str]) -> None:
    assert sentences(text) == expected


def test_a_long_latin_sentence_is_cut_at_a_clause_mark_then_at_a_space() -> None:
    text = (
        "This sentence runs on and on for a while, then it takes a breath; and then it goes on with more words "
        "and more words and more words and more words until it ends."
    )
    pieces = sentences(text, max_chars=60)
    assert "".join(f"{p} " for p in pieces).strip() == text
    assert pieces[0].endswith(",") and pieces[1].endswith(";")
    assert all(len(p) <= 60 for p in pieces) and len(pieces) >= 4
    assert all(not p.endswith(("an", "wor", "mor")) for p in pieces)  # whole words only


def test_a_long_cjk_sentence_is_cut_at_a_comma_and_with_none_between_characters() -> None:
    clause = "这是一个很长的句子" * 3  # 27 characters, no space
    text = f"{clause}，{clause}，{clause}。"
    pieces = sentences(text, max_chars=40)
    assert "".join(pieces) == text and all(len(p) <= 40 for p in pieces)
    assert pieces[0] == f"{clause}，"
    no_marks = "的" * 95 + "。"
    cut = sentences(no_marks, max_chars=40)
    assert "".join(cut) == no_marks and [len(p) for p in cut] == [40, 40, 16]


def test_one_enormous_word_is_cut_and_keeps_accents_with_their_letters() -> None:
    word = "e\u0301" * 50  # NFC composes these; a decomposed-only mark stays with its letter
    assert sentences(word, max_chars=20) == ["é" * 20, "é" * 20, "é" * 10]
    combining = "q\u0323\u0307" * 30  # no precomposed form: the marks must not start a piece
    pieces = sentences(combining, max_chars=20)
    assert "".join(pieces) == combining and all(p[0] not in "\u0323\u0307" for p in pieces)


def test_sentences_are_packed_up_to_the_target_and_paragraphs_never_mix() -> None:
    text = "One. Two. Three. Four.\n\nFive. Six."
    chunks = split(text, target_chars=10, max_chars=40)
    assert [(c.text, c.boundary) for c in chunks] == [
        ("One. Two.", "sentence"),
        ("Three.", "sentence"),
        ("Four.", "paragraph"),
        ("Five. Six.", "end"),
    ]
    assert [len(c.sentences) for c in chunks] == [2, 1, 1, 2]
    assert [
        c.boundary for c in split("A very long sentence that must be cut somewhere.", target_chars=20, max_chars=20)
    ] == ["split", "split", "end"]


def test_empty_text_has_no_chunks_and_bad_limits_are_refused() -> None:
    assert split(" \n\n \t", target_chars=10, max_chars=20) == []
    with pytest.raises(ValueError, match="target_chars"):
        split("Hello.", target_chars=30, max_chars=20)
