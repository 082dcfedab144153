"""The documentation keeps up with the code: the configuration reference is generated and fresh, every
example a page shows is a file that runs against real services, and every relative link resolves."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import soundfile as sf
from support import GatewayProcess, WorkerProcess, api_key, settings_env

from ttsq.config import Settings

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
EXAMPLES = DOCS / "examples"
GENERATOR = DOCS / "config_reference.py"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
#: What the README's table of documentation links to: one row per page.
DOC_PAGES = {
    "deployment.md",
    "scaling.md",
    "kubernetes.md",
    "systemd.md",
    "gateway.md",
    "configuration.md",
    "qwen.md",
    "documents.md",
    "task-contract.md",
    "guarantees.md",
    "security.md",
    "benchmarks.md",
    "scheduling.md",
    "development.md",
    "high-availability.md",
    "observability.md",
    "streaming.md",
    "timestamps.md",
}


def run_generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=60)


# --- the configuration reference -------------------------------------------------------------------


def test_the_configuration_reference_is_fresh() -> None:
    out = run_generator("--check")
    assert out.returncode == 0, out.stderr


def test_the_check_names_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(
        (DOCS / "configuration.md").read_text(encoding="utf-8").replace("| `8` |", "| `9` |"), encoding="utf-8"
    )
    out = run_generator("--check", "--output", str(stale))
    assert out.returncode == 1
    assert f"{stale} is stale" in out.stderr
    assert run_generator("--check", "--output", str(tmp_path / "missing.md")).returncode == 1


def test_a_setting_without_a_comment_is_refused(tmp_path: Path) -> None:
    source = (ROOT / "ttsq" / "config.py").read_text(encoding="utf-8")
    # Drop the #: comment lines directly above one field.
    undocumented = re.sub(r"(?:\n[ ]*#:[^\n]*)+(\n[ ]*max_batch: )", r"\1", source, count=1)
    assert undocumented != source
    copy = tmp_path / "config.py"
    copy.write_text(undocumented, encoding="utf-8")
    out = run_generator("--source", str(copy), "--output", str(tmp_path / "configuration.md"))
    assert out.returncode != 0
    assert "max_batch" in out.stderr and not (tmp_path / "configuration.md").exists()


def test_every_setting_has_a_row_with_its_default_and_comment() -> None:
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(TTSQ_[A-Z0-9_]+)` \|.*$", page, re.M)}
    expected = {f"TTSQ_{field.name.upper()}": field for field in dataclasses.fields(Settings)}
    assert set(rows) == set(expected)
    for variable, field in expected.items():
        cells = [cell.strip() for cell in rows[variable].strip("|").split(" | ")]
        assert cells[2] == (f"`{field.default}`" if field.default != "" else "(empty)"), variable
        assert len(cells[3]) > 20, f"{variable} has no real description"
    # Facts that must survive the move from the README's table into the comments.
    assert "`<queue>.custom_voice`" in rows["TTSQ_QUEUE"] and "`<queue>.voice_clone`" in rows["TTSQ_QUEUE"]
    assert "983 characters" in rows["TTSQ_DOC_MAX_CHARS"] and "248 characters" in rows["TTSQ_DOC_MAX_CHARS"]
    assert "1.25 × (600 + 121.5) → 902 s" in page


def test_every_ttsq_variable_the_docs_name_is_a_setting() -> None:
    known = {f"TTSQ_{field.name.upper()}" for field in dataclasses.fields(Settings)}
    named = {
        (page.name, m.group(0))
        for page in PAGES
        for m in re.finditer(r"TTSQ_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_*])", page.read_text(encoding="utf-8"))
    }
    assert len(named) > 30
    assert sorted(f"{page}: {name}" for page, name in named if name not in known) == []


def test_every_ttsq_command_the_docs_name_exists() -> None:
    """Issue 43, Why 4: high-availability.md named a `ttsq fleet` that never existed."""
    from ttsq.cli.main import cli

    named = {
        (page.name, m.group(1))
        for page in PAGES
        for m in re.finditer(r"`ttsq ([a-z][a-z-]*)", page.read_text(encoding="utf-8"))
    }
    assert len(named) > 20
    assert sorted(f"{page}: ttsq {name}" for page, name in named if name not in cli.commands) == []


# --- the examples ----------------------------------------------------------------------------------


def run_example(name: str, settings: Settings, tmp_path: Path) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        env=settings_env(settings),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


def fetch_duration(output: str) -> float:
    """Download the URL an example printed, as a browser would, and measure the audio in it."""
    url = re.search(r"^url: (http://127\.0\.0\.1:\d+/\S+)$", output, re.M)
    assert url, output
    with urllib.request.urlopen(url.group(1), timeout=30) as response:
        audio, rate = sf.read(io.BytesIO(response.read()))
    return float(len(audio) / rate)


def check_send_task(output: str) -> None:
    line = re.search(
        r"^(\d+\.\d+) s of mp3 at (\d+) Hz by espeak \(batch of (\d+)\), key [0-9a-f]{12}, "
        r"ignored: \['instruct'\]$",
        output,
        re.M,
    )  # espeak cannot follow a voice description
    assert line, output
    assert float(line.group(1)) > 1.0 and int(line.group(3)) >= 1
    assert abs(fetch_duration(output) - float(line.group(1))) < 0.2
    assert re.search(r"^refused: InvalidRequest on 'language': ", output, re.M), output


def check_client_submit(output: str) -> None:
    line = re.search(r"^(\d+\.\d+) s of mp3 by w1@test, batch of (\d+), synthesis \d+\.\d+ s$", output, re.M)
    assert line, output
    assert float(line.group(1)) > 1.0
    assert abs(fetch_duration(output) - float(line.group(1))) < 0.2
    assert "again: cached=True, same key=True" in output.splitlines()
    assert re.search(r"^refused: invalid language: ", output, re.M), output


def check_document_submit(output: str) -> None:
    queued = re.search(r"^(\d+) chunks, job \S+$", output, re.M)
    done = re.search(r"^(\d+\.\d+) s of mp3 from (\d+) chunks \(0 from the cache\), key [0-9a-f]{12}$", output, re.M)
    assert queued and done, output
    chunks = re.findall(r"^  chars +\d+- *\d+ +(\d+\.\d+)- *(\d+\.\d+) s  (\w+)$", output, re.M)
    assert int(queued.group(1)) == int(done.group(2)) == len(chunks) >= 3  # three paragraphs, never crossed
    assert [boundary for *_, boundary in chunks].count("paragraph") == 2 and chunks[-1][2] == "end"
    assert abs(float(chunks[-1][1]) - float(done.group(1))) < 0.01  # the last chunk ends the file
    assert abs(fetch_duration(output) - float(done.group(1))) < 0.2


CHECKS: dict[str, Callable[[str], None]] = {
    "send_task.py": check_send_task,
    "client_submit.py": check_client_submit,
    "document_submit.py": check_document_submit,
}
TLS_OVERRIDE = EXAMPLES / "docker-compose.tls.yml"


def check_gateway_sh(output: str, folder: Path) -> None:
    assert re.search(r"^speech: \d+ bytes of mp3$", output, re.M), output
    job = re.search(r"^job (\S+): \d+ bytes of wav$", output, re.M)
    assert job, output
    for name, least in (("hello.mp3", 0.8), ("job.wav", 1.0)):
        audio, rate = sf.read(folder / name)
        assert len(audio) / rate > least, name
    assert json.loads(output.strip().splitlines()[-1])["error"]["code"] == "not_found"


def check_openai_speech(output: str, folder: Path) -> None:
    # The headers go out with the first streamed audio: the engine's own ignored fields (espeak: instruct,
    # seed) come later, with the job's result (docs/gateway.md).
    assert re.search(r"^ignored: voice, job key [0-9a-f]{12}$", output, re.M), output
    audio, rate = sf.read(folder / "hello.wav")
    assert len(audio) / rate > 1.5
    assert re.search(r"^refused: speed: .*invalid speed: 1\.5 cannot be applied", output, re.M), output


GATEWAY_CHECKS: dict[str, Callable[[str, Path], None]] = {
    "gateway.sh": check_gateway_sh,
    "openai_speech.py": check_openai_speech,
}


def test_every_example_file_is_checked_here() -> None:
    assert {path.name for path in EXAMPLES.iterdir() if path.is_file()} == {*CHECKS, *GATEWAY_CHECKS, TLS_OVERRIDE.name}


@pytest.mark.parametrize("name", sorted(GATEWAY_CHECKS))
def test_the_gateway_example_runs_against_a_real_gateway(
    name: str,
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    start_gateway: Callable[..., GatewayProcess],
    tmp_path: Path,
) -> None:
    start_worker(settings)
    gateway = start_gateway(settings)
    env = {**settings_env(settings), "OPENAI_BASE_URL": f"{gateway.url}/v1", "OPENAI_API_KEY": api_key(settings)}
    command = ["bash", str(EXAMPLES / name)] if name.endswith(".sh") else [sys.executable, str(EXAMPLES / name)]
    out = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    GATEWAY_CHECKS[name](out.stdout, tmp_path)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_example_runs_against_a_real_worker(
    name: str, settings: Settings, start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    settings = settings.replace(queue="ttsq")  # the examples name the default queue; this Redis is the test's own
    start_worker(settings)
    CHECKS[name](run_example(name, settings, tmp_path))


def test_the_tls_override_merges_with_the_compose_file() -> None:
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    out = subprocess.run(
        [
            str(binary),
            "-f",
            str(ROOT / "docker-compose.yml"),
            "-f",
            str(TLS_OVERRIDE),
            "--env-file",
            str(ROOT / ".env.example"),
            "--project-directory",
            str(ROOT),
            "--profile",
            "cpu",
            "--profile",
            "gpu",
            "config",
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    assert services["redis"]["command"][:4] == ["redis-server", "--port", "0", "--tls-port"]
    assert "--tls" in services["redis"]["healthcheck"]["test"][1]
    clients = [name for name, service in services.items() if str(service.get("image")).startswith("ttsq:")]
    assert len(clients) >= 4  # worker-cpu, worker-gpu0, worker-gpu1, flower
    for name in clients:  # every ttsq service talks to Redis over verified TLS
        environment = services[name]["environment"]
        urls = {
            key: value
            for key, value in environment.items()
            if key in ("TTSQ_BROKER_URL", "TTSQ_RESULT_BACKEND", "TTSQ_CACHE_URL")
        }
        assert urls and all(url.startswith("rediss://") and "ssl_cert_reqs=required" in url for url in urls.values()), (
            name
        )
        assert "/tls/ca.crt" in {volume["target"] for volume in services[name].get("volumes", [])}, name
        Settings.from_env({key: value for key, value in environment.items() if key.startswith("TTSQ_")})


#: ``<!-- example: PATH -->`` before a code block: the block is the whole file; ``excerpt``: a part of it.
SHOWN = re.compile(r"^<!-- (example|excerpt): (\S+) -->\n```\w+\n(.*?)^```$", re.S | re.M)


def test_the_examples_shown_in_the_docs_are_the_files() -> None:
    shown: set[str] = set()
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        markers = re.findall(r"^<!-- (?:example|excerpt): ", text, re.M)
        assert len(markers) == len(SHOWN.findall(text)), f"{page.name}: a marker without a code block after it"
        for kind, path, block in SHOWN.findall(text):
            file = (page.parent / path).resolve()
            assert file.parent == EXAMPLES.resolve() and file.exists(), f"{page.name}: {path} is not an example"
            content = file.read_text(encoding="utf-8")
            if kind == "example":
                assert block == content, f"{page.name} shows an old copy of {path}"
                shown.add(file.name)
            else:
                assert block.count("\n") >= 3 and block in content, f"{page.name} quotes {path} as it no longer is"
    assert shown == {*CHECKS, *GATEWAY_CHECKS, TLS_OVERRIDE.name}


# --- every Python and shell block of docs/ --------------------------------------------------------

#: A fenced Python or shell block, and the marker that precedes an example file's copy.
BLOCK = re.compile(r"^```(python|bash|sh|shell)\n(.*?)^```$", re.S | re.M)
#: The first line of a block the tests cannot run, saying why: ``# not run here: needs a GPU``.
NOT_RUN = re.compile(r"\A# not run here: (\S.{9,})$", re.M)


def doc_blocks() -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """The blocks of docs/ to run, as ``(where, language, code)``, and those that say why they cannot, as
    ``(where, why)``. An example file's copy is neither: the example tests above run the file itself."""
    run, skipped = [], []
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            where = f"{page.name}:{text[: match.start()].count(chr(10)) + 1}"
            if re.search(r"^<!-- (?:example|excerpt): \S+ -->\n\Z", text[: match.start()], re.M):
                continue
            language, code = match.group(1), match.group(2)
            why = NOT_RUN.search(code)
            if why:
                skipped.append((where, why.group(1)))
            else:
                run.append((where, language, code))
    return run, skipped


def test_every_python_and_shell_block_of_the_docs_runs_or_says_why_not() -> None:
    run, skipped = doc_blocks()
    pages = {where.split(":")[0] for where, *_ in run}
    assert {"gateway.md", "streaming.md"} <= pages, pages  # the newcomer's road, run as written
    assert all(len(why) >= 10 for _, why in skipped)
    # A marker anywhere but the first line says nothing about the block: it would be run, and fail.
    for where, _, code in run:
        assert "# not run here" not in code, f"{where}: the marker goes on the block's first line"


@pytest.mark.slow  # a private Redis, a worker and a gateway, then every block: minutes on two cores
def test_the_docs_blocks_run_against_ttsq_serve_embedded(tmp_path: Path) -> None:
    """As a reader runs them: ``ttsq serve --embedded`` in one shell, its ``export`` lines in another,
    then each block of docs/ in turn, in one folder (a block may use a file an earlier one wrote)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "OPENAI_"))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # `ttsq`, `python`
    server = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "serve", "--embedded", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "serve.log").open("wb"),
        text=True,
    )
    try:
        assert server.stdout is not None
        exports = {}
        for line in (server.stdout.readline().strip() for _ in range(3)):
            assert line.startswith("export "), (tmp_path / "serve.log").read_text()
            exports.update(pair.split("=", 1) for pair in line.removeprefix("export ").split())
        failed = []
        for where, language, code in doc_blocks()[0]:
            command = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
            out = subprocess.run(
                command, cwd=tmp_path, env={**env, **exports}, capture_output=True, text=True, timeout=180
            )
            if out.returncode != 0:
                failed.append(f"{where} ({language}) exited {out.returncode}: {out.stderr[-1500:]}")
        assert failed == [], "\n".join(failed)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]


# --- links and the front page ----------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # code is not prose
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_resolves() -> None:
    broken, count = [], 0
    for page in PAGES:
        for target in links(page):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            count += 1
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert count > 40
    assert broken == []


def test_the_readme_links_every_docs_page() -> None:
    assert {path.name for path in DOCS.glob("*.md")} == DOC_PAGES
    linked = {target.split("#")[0] for target in links(README)}
    assert {f"docs/{name}" for name in DOC_PAGES} <= linked


def test_the_readme_is_a_front_page() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) < 200


def test_the_readme_test_command_is_what_ci_runs() -> None:
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/pytest"
    assert f"```\n{command}\n```" in README.read_text(encoding="utf-8")
    assert command in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
