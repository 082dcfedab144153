"""The gateway's ``/playground`` page: served from the installed package under a strict Content-Security-Policy,
and used in a real browser (Debian's Chromium, headless, driven by Playwright; nothing downloaded) against a
real ``ttsq serve --embedded`` (its private Redis, espeak worker and gateway): the voices come from the server,
Speak plays pcm as it arrives with the word being said highlighted, the history plays a job's stored file, and
a document's chunk progress runs to its end.

``PLAYGROUND_SCREENSHOT=1`` makes the browser test save docs/playground.png from its own run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SECRET, GatewayProcess, missing_tool

from ttsq.config import Settings
from ttsq.gateway.playground import page_config

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "ttsq" / "gateway" / "playground"
ASSETS = ("index.html", "player.js", "app.js", "style.css", "icon.svg")
SCREENSHOT = ROOT / "docs" / "playground.png"

StartGateway = Callable[..., GatewayProcess]


def test_page_is_served_under_a_policy_of_this_origin_only(settings: Settings, start_gateway: StartGateway) -> None:
    gateway = start_gateway(settings)
    page = httpx.get(f"{gateway.url}/playground", timeout=10)  # no key: the page holds none
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for name, kind in (("player.js", "text/javascript"), ("app.js", "text/javascript"), ("style.css", "text/css")):
        asset = httpx.get(f"{gateway.url}/playground/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), name
        assert asset.content == (PAGE / name).read_bytes()
        assert asset.headers["content-security-policy"] == policy
    config = httpx.get(f"{gateway.url}/playground/config.json", timeout=10).json()
    assert config["auth"] is True and config["max_text_chars"] == settings.max_text_chars
    assert "pcm" in config["formats"] and "auto" in config["languages"]
    slashed = httpx.get(f"{gateway.url}/playground/", timeout=10, follow_redirects=True)
    assert slashed.status_code == 200 and slashed.url.path == "/playground"
    missing = httpx.get(f"{gateway.url}/playground/secrets.txt", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
    # The page is not the API: /openapi.json does not list it.
    assert not any(path.startswith("/playground") for path in httpx.get(f"{gateway.url}/openapi.json").json()["paths"])


def test_the_page_is_told_whether_a_key_is_needed(settings: Settings) -> None:
    assert page_config(settings)["auth"] is True
    assert page_config(settings.replace(gateway_auth="none"))["auth"] is False  # loopback dev: no key asked


def test_page_names_no_other_origin() -> None:
    """Nothing the page loads or calls is elsewhere: no absolute URL in its files (the policy would refuse it,
    and a person reading the page's source sees it cannot)."""
    for name in ASSETS:
        source = (PAGE / name).read_text().replace('xmlns="http://www.w3.org/2000/svg"', "")  # a name, not a place
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", source, re.IGNORECASE), name
        assert "@import" not in source and "url(" not in source, name


@pytest.mark.slow  # a wheel build: half a minute
def test_wheel_ships_the_page(tmp_path: Path) -> None:
    """A wheel built from the source holds the page's files (``pip install '.[gateway]'`` serves them). Built
    from a copy, so the build leaves nothing in the work tree."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("ttsq", "cli", "workers"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("ttsq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in (*ASSETS, "__init__.py"):
        assert f"ttsq/gateway/playground/{name}" in names


# -- in a real browser ---------------------------------------------------------------------------------------


def chromium() -> str:
    """Debian's Chromium (``.ci/run`` installs it)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        missing_tool("no Chromium: apt-get install chromium (.ci/run does)")
    return found


@pytest.fixture
def browser_page() -> Iterator[Any]:
    """A headless Chromium page; what the page logs as an error (a refused resource, a script error) fails
    the test."""
    executable = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_tool("no playwright: pip install -e '.[test]'")
    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            # Web Audio may start without a person's gesture (the test's presses are not one).
            args=["--autoplay-policy=no-user-gesture-required"],
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on(
                "response",
                lambda response: errors.append(f"{response.status} {response.url}") if response.status >= 400 else None,
            )
            page.set_default_timeout(60_000)
            yield page
        finally:
            browser.close()
    assert not errors, errors


def metrics(page: Any) -> dict[str, Any]:
    return dict(page.evaluate("() => ({...window.ttsqPlayground.metrics})"))


def report(what: str, measured: dict[str, Any]) -> None:
    """What the page measured, printed (never asserted: the machine's load decides it)."""
    print(
        f"\nplayground, espeak pcm, {what}: first audio {measured['firstAudioMs']:.0f} ms, first byte "
        f"{measured['firstByteMs']:.0f} ms, {measured['audioS']:.2f} s of audio, real-time factor "
        f"{measured['rtf']:.3f}, {measured['underruns']} underruns"
    )


def document_text() -> str:
    """About 5,000 characters, every sentence its own (a repeated chunk would be made once)."""
    sentences = [
        f"Sentence {i} of the playground's document reads a few words about item number {i} aloud."
        for i in range(1, 200)
    ]
    text = ""
    for sentence in sentences:
        if len(text) + len(sentence) + 1 > 5000:
            break
        text += sentence + " "
    return text.strip()


@contextmanager
def serve_embedded(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """``ttsq serve --embedded`` as a newcomer runs it: (its URL, its key, the playground link it prints)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "OPENAI_"))}
    env["TTSQ_MAX_TEXT_CHARS"] = "1000"  # 5,000 characters: a document of a couple dozen chunks
    log = tmp_path / "serve.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "serve", "--embedded", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("wb"),
        text=True,
        start_new_session=True,
    )
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline().strip() for _ in range(4)]  # the first lines; EOF if it died
        assert lines[3].startswith("# the playground"), (lines, log.read_text())
        exports = dict(pair.partition("=")[::2] for line in lines[:3] for pair in line.removeprefix("export ").split())
        yield exports["OPENAI_BASE_URL"].removesuffix("/v1"), exports["OPENAI_API_KEY"], lines[3].split()[-1]
    finally:
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(60) == 0, log.read_text()
        assert SECRET not in log.read_text()


@pytest.mark.slow
def test_playground_in_chromium(
    browser_page: Any, settings: Settings, start_gateway: StartGateway, tmp_path: Path
) -> None:
    # The browser first: without one, the test is skipped (or fails, in CI) before it starts any process.
    with serve_embedded(tmp_path) as served:
        browse(browser_page, settings, start_gateway, *served)


def browse(page: Any, settings: Settings, start_gateway: StartGateway, url: str, token: str, link: str) -> None:
    kept = httpx.post(
        f"{url}/v1/audio/voices",
        headers={"Authorization": f"Bearer {token}"},
        json={"name": "playground-narrator", "instruct": "a calm narrator", "language": "english", "seed": 7},
        timeout=10,
    )
    assert kept.status_code == 201, kept.text

    page.goto(f"{url}/playground")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('API key')")
    # The key, typed once and sent with Enter; kept in the tab's session storage.
    page.fill("#key", token)
    page.press("#key", "Enter")
    page.wait_for_function("() => window.ttsqPlayground.page.voices.length > 0")
    voices = page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert "playground-narrator" in voices  # the named voice, from GET /v1/audio/voices
    models = page.eval_on_selector_all("#model option", "options => options.map(o => o.value)")
    assert "espeak-ng" in models and "tts-1" in models  # from GET /v1/models
    assert page.evaluate("() => sessionStorage.getItem('ttsq.playground.key')") == token
    # Every control has a label (a <label for>, or its own text), and the status is announced politely.
    unlabelled = page.evaluate(
        "() => [...document.querySelectorAll('input, select, textarea, button')]"
        ".filter(el => !el.closest('[hidden]'))"
        ".filter(el => !(el.labels && el.labels.length) && !el.textContent.trim() && !el.getAttribute('aria-label'))"
        ".map(el => el.id || el.outerHTML)"
    )
    assert unlabelled == []
    assert page.get_attribute("#status", "aria-live") == "polite"

    # Speak, from the keyboard: the text, then Speak focused and pressed.
    page.fill("#text", f"{SECRET}. The playground plays this as it arrives.")
    page.select_option("#voice", "playground-narrator")
    page.focus("#speak")
    page.keyboard.press("Enter")
    page.wait_for_function("() => window.ttsqPlayground.metrics.state === 'playing'")
    page.wait_for_function("() => window.ttsqPlayground.metrics.playedS > 0.2")  # the player's clock runs
    page.wait_for_function("() => ['done', 'failed'].includes(window.ttsqPlayground.metrics.state)")
    spoken = metrics(page)
    assert spoken["state"] == "done", page.text_content("#error")
    assert spoken["samples"] > 0 and spoken["sampleRate"] == 24_000
    assert spoken["bytes"] == 2 * spoken["samples"]  # 16-bit pcm, every byte played
    assert spoken["audioS"] > 1.0 and spoken["playedS"] == pytest.approx(spoken["audioS"], abs=0.05)
    assert spoken["jobId"]
    report("first Speak (cold gateway and worker)", spoken)
    # The result carries word timestamps (espeak's own): the read-along shows them, once the job's result is
    # stored, a moment after its stream ended (the page reads the job's state until it ends: read once,
    # at the stream's end, it was still STARTED in a full CI run, and no words were shown).
    page.wait_for_function("() => window.ttsqPlayground.metrics.words >= 5")
    assert page.is_visible("#readalong")
    # The page's own read-along, given words in the shape results will carry: the word under the playhead
    # is marked (and announced as current), the others not.
    page.evaluate(
        "() => { showWords([{word: 'The', start: 0, end: 0.4}, {word: 'Heron', start: 0.4, end: 0.9}]);"
        " highlight(0.5); }"
    )
    marked = page.eval_on_selector_all("#readalong span.current", "spans => spans.map(s => s.textContent)")
    assert marked == ["Heron"] and page.is_visible("#readalong")
    assert page.get_attribute("#readalong span.current", "aria-current") == "true"

    # The history holds the job; Play reads its stored file (a WAV) through /v1/jobs/{id}/audio.
    assert page.locator("#history li").count() == 1
    page.click("#history li button:has-text('Play')")
    page.wait_for_function("() => ['done', 'failed'].includes(window.ttsqPlayground.metrics.state)")
    again = metrics(page)
    assert again["state"] == "done", page.text_content("#error")
    assert again["audioS"] == pytest.approx(spoken["audioS"], abs=0.1) and again["playedS"] > 1.0

    # Speak again, another text: first audio once the gateway and the worker are warm.
    page.fill("#text", "A second text, once everything is warm.")
    page.click("#speak")
    page.wait_for_function("() => ['done', 'failed'].includes(window.ttsqPlayground.metrics.state)")
    warm = metrics(page)
    assert warm["state"] == "done" and warm["samples"] > 0, page.text_content("#error")
    report("second Speak (warm)", warm)

    # A document: submitted through the jobs API, its chunks' progress followed to its end, and streamed
    # through the speech route meanwhile, chunk by chunk: the same request, so the same document (one synthesis).
    text = document_text()
    assert len(text) > 4900
    page.fill("#text", text)
    page.click("#speak")
    page.wait_for_function(
        "() => { const m = window.ttsqPlayground.metrics;"
        " return m.state === 'failed' || (m.state === 'playing' && m.document && m.document.phase === 'done') }",
        timeout=180_000,
    )
    document = metrics(page)
    assert document["state"] == "playing", page.text_content("#error")
    progress = document["document"]
    assert progress["total"] > 10 and progress["done"] == progress["total"], progress
    assert page.get_attribute("#doc-progress", "value") == page.get_attribute("#doc-progress", "max")
    assert page.text_content("#doc-text").startswith(f"{progress['total']}/{progress['total']} chunks")
    assert document["streamKey"] == document["documentKey"] is not None
    print(f"document: {progress['total']} chunks, progress seen {document['progressSeen']}")
    report("a document streamed while it is made", document)
    page.wait_for_function("() => window.ttsqPlayground.metrics.playedS > 0.2")
    if os.environ.get("PLAYGROUND_SCREENSHOT") == "1":
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    page.click("#stop")
    assert metrics(page)["state"] == "stopped"
    assert page.locator("#history li").count() == 3

    # TTSQ_GATEWAY_AUTH=none (a trusted network, loopback development): no key asked, ready at once.
    open_gateway = start_gateway(settings.replace(gateway_auth="none"), name="open-gateway")
    named = {"name": "keyless-narrator", "instruct": "a calm narrator", "language": "english"}
    assert httpx.post(f"{open_gateway.url}/v1/audio/voices", json=named, timeout=10).status_code == 201
    keyless = page.context.browser.new_page()
    try:
        keyless.goto(f"{open_gateway.url}/playground")
        keyless.wait_for_function("() => window.ttsqPlayground.page.voices.length > 0")
        assert keyless.is_hidden("#key-section")
    finally:
        keyless.close()

    # The link serve --embedded prints carries the key in its fragment: a fresh tab is ready at once, and the
    # key leaves the URL.
    assert link == f"{url}/playground#key={token}"
    fresh = page.context.browser.new_page()
    try:
        fresh.goto(link)
        fresh.wait_for_function("() => window.ttsqPlayground.page.voices.length > 0")
        assert "#" not in fresh.url
        assert fresh.evaluate("() => sessionStorage.getItem('ttsq.playground.key')") == token
    finally:
        fresh.close()
