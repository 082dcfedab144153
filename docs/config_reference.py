"""Write docs/configuration.md from the ``#:`` comments above the fields of ``ttsq.config.Settings``.

Run from anywhere::

    .venv/bin/python docs/config_reference.py           # rewrite docs/configuration.md
    .venv/bin/python docs/config_reference.py --check   # exit 1, naming the file, if it is stale

The field names, types and comments come from parsing ``ttsq/config.py`` with ``ast`` (nothing in it
runs for that); the defaults come from ``dataclasses.fields(Settings)``, so a computed default such as
``30 * 24 * 3600`` shows as the number a worker really uses. A field without a ``#:`` comment is an
error: every setting is documented, or the reference (and its test) refuses to build.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "ttsq" / "config.py"
OUTPUT = ROOT / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python docs/config_reference.py"

INTRODUCTION = """\
Every ttsq process (worker, launcher, producer, `ttsq submit`, `ttsq flower`) reads the `TTSQ_*`
environment variables below, once, at start; where a command has a flag of the same name, the flag wins
(`ttsq worker --max-batch 16`). From Python, `Settings.from_env()` in `ttsq/config.py` reads the same
variables, and `Settings(...)` or `settings.replace(...)` builds one directly. Nothing in ttsq reads the
environment at import time. `ttsq COMMAND --help` names each flag's variable (`[env var: TTSQ_...]`), the
connection flags (`--broker-url`, `--result-backend`, `--cache-url`, `--storage-url`) go before or after
the command's name, and `ttsq config` prints the settings in effect, each with where it came from (a flag,
the environment, the default), secrets masked (`--json` for a script).

S3 credentials are deliberately not settings: they come from boto3's own chain (`AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY`, the shared config files, an instance role), so they never travel in task
arguments or results. Producers and workers of one deployment must agree on the Redis URLs, the
storage and `TTSQ_QUEUE`, and the workers of one queue on the engine and model (producers need no engine
setting: they read what the workers announce); see [deployment.md](deployment.md). The `TTSQ_QWEN_*`
settings (rows marked "qwen:") are read by the two Qwen3-TTS engines, `qwen` and `qwen-fast`, only
([qwen.md](qwen.md)); the `TTSQ_DOC_*` settings by long documents ([documents.md](documents.md)).
"""

VALIDATION = """\
## Validation at start

A malformed value stops the process at start with one line naming the variable (exit status 2 on the
command line), before anything connects or loads. So does a visibility timeout that a healthy job could
outlive: it must be at least 1.25 × (`TTSQ_JOB_TIMEOUT_S` + the storage budget), where the storage budget
is `TTSQ_STORAGE_ATTEMPTS` × 2 requests × 2 × `TTSQ_STORAGE_TIMEOUT_S` plus the longest backoff pauses
(defaults: 1.25 × ({job_timeout} + {storage_budget}) → {min_visibility} s, under the default {visibility} s).
`TTSQ_JOB_TIMEOUT_S` must be below the visibility timeout, and `TTSQ_BATCH_TIMEOUT_S` at most half of
`TTSQ_JOB_TIMEOUT_S` (a job waits for the batch ahead of it, then for its own). A worker whose engine
can say what a batch costs (the stand-in) also refuses to start when a full batch (`TTSQ_MAX_BATCH`
texts of `TTSQ_MAX_TEXT_CHARS`) would outlast that per-batch limit, past which its watchdog ends it as
stuck. Why these bounds rule out a duplicate run of a healthy job: [guarantees.md](guarantees.md).
"""

TABLE_HEADER = """\
## Variables

| variable | type | default | meaning |
| --- | --- | --- | --- |
"""


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    type: str
    comment: str


def parse_fields(source: str) -> list[Field]:
    """The fields of ``class Settings`` in order, each with its joined ``#:`` comment."""
    tree = ast.parse(source)
    settings = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Settings"), None)
    if settings is None:
        raise SystemExit("config_reference: no class Settings in ttsq/config.py")
    lines = source.splitlines()
    fields, undocumented = [], []
    for node in settings.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        comment: list[str] = []
        index = node.lineno - 2  # the line directly above the field (lineno counts from 1)
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if not comment:
            undocumented.append(node.target.id)
        fields.append(Field(node.target.id, ast.unparse(node.annotation), " ".join(comment)))
    if undocumented:
        raise SystemExit(
            "config_reference: these Settings fields have no #: comment above them in "
            f"ttsq/config.py: {', '.join(undocumented)}"
        )
    return fields


def markdown(text: str) -> str:
    """A comment as a table cell: reST ``code`` becomes `code`, bare TTSQ_ names are code too."""
    parts = re.split(r"(``.+?``)", text)
    out = []
    for part in parts:
        if part.startswith("``") and part.endswith("``"):
            out.append(f"`{part[2:-2]}`")
        else:
            out.append(re.sub(r"\b(TTSQ_[A-Z0-9_]+)\b", r"`\1`", part))
    return "".join(out).replace("|", "\\|")


def show_default(value: object) -> str:
    if value == "":
        return "(empty)"
    return f"`{value}`"


def render(source: str) -> str:
    sys.path.insert(0, str(ROOT))
    from ttsq.config import ENV_PREFIX, Settings

    fields = parse_fields(source)
    defaults = {field.name: field.default for field in dataclasses.fields(Settings)}
    if [field.name for field in fields] != list(defaults):
        raise SystemExit(
            "config_reference: the fields parsed from the source differ from Settings' own "
            f"({[field.name for field in fields]} vs {list(defaults)})"
        )
    rows = [
        f"| `{ENV_PREFIX}{field.name.upper()}` | {field.type} | {show_default(defaults[field.name])} | "
        f"{markdown(field.comment)} |"
        for field in fields
    ]
    default = Settings()
    validation = VALIDATION.format(
        job_timeout=default.job_timeout_s,
        storage_budget=f"{default.storage_budget_s:g}",
        min_visibility=default.min_visibility_timeout_s,
        visibility=default.visibility_timeout_s,
    )
    generated = (
        f"# Configuration\n\n<!-- Generated by docs/config_reference.py from the #: comments above the "
        f"fields of Settings in ttsq/config.py. Do not edit by hand: edit the comments, then run "
        f"{REGENERATE} -->\n\n"
    )
    return "\n".join([generated + INTRODUCTION, TABLE_HEADER + "\n".join(rows) + "\n", validation])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the output file is stale; write nothing")
    parser.add_argument("--source", type=Path, default=SOURCE, help="the settings module to read (ttsq/config.py)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the page to write (docs/configuration.md)")
    args = parser.parse_args(argv)
    text = render(args.source.read_text(encoding="utf-8"))
    current = args.output.read_text(encoding="utf-8") if args.output.exists() else None
    if args.check:
        if current != text:
            print(
                f"{args.output} is stale: the Settings comments in ttsq/config.py changed; run {REGENERATE}",
                file=sys.stderr,
            )
            return 1
        print(f"{args.output} is up to date")
        return 0
    if current != text:
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}")
    else:
        print(f"{args.output} was already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
