"""The Grafana dashboard and the alert rules, checked against the real tools.

``deploy/grafana/ttsq.json`` must be a dashboard Grafana imports; ``deploy/prometheus/ttsq-alerts.yml``
must pass ``promtool check rules`` and its own ``promtool test rules`` cases. Then the test that
matters: Debian's Prometheus scrapes a real worker (espeak) and a real gateway while they serve jobs, a
cache hit, HTTP errors, a dead letter and a parked job among them, and every panel's query and every
alert's expression is evaluated through its HTTP API. A query that does not parse, names a series no
process exports, or returns nothing fails the test, except the GPU series on a machine without NVML
(``GPU_SERIES``). The checker is shown to catch a wrong metric name and a syntax error.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support import SECRET, GatewayProcess, WorkerProcess, api_key, missing_tool, scrape, stop_process, value

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.redis_server import free_port
from ttsq.records.connection import connect
from ttsq.worker.metrics import Metrics

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "ttsq.json"
RULES = ROOT / "deploy" / "prometheus" / "ttsq-alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "ttsq-alerts.test.yml"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
OBSERVABILITY = ROOT / "docs" / "observability.md"

#: Series only NVML provides (``ttsq/worker/metrics.py``): a worker without a GPU and a driver has none,
#: so on such a machine the queries that read them are excepted, and listed. Nothing else is.
GPU_SERIES = frozenset({"ttsq_gpu_utilization_ratio", "ttsq_gpu_memory_used_bytes", "ttsq_gpu_memory_total_bytes"})
#: What the dashboard's variables stand for when its queries go to Prometheus directly: Grafana's
#: ``$__rate_interval`` is at least four scrape intervals, and "All" queues is the variable's allValue.
VARIABLES = {"$__rate_interval": "2m", "$__interval": "15s", "${queue}": ".*", "$queue": ".*"}

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
Query = tuple[str, str]  # where it is (panel or alert), the expression


# -- reading the dashboard and the rules ----------------------------------------------------------


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in model["panels"]:
        yield panel
        yield from panel.get("panels", [])


def panel_queries(model: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, expression, legend) of every target of every panel."""
    return [
        (f"panel {panel['title']!r} {target['refId']}", target["expr"], target.get("legendFormat", ""))
        for panel in panels(model)
        for target in panel.get("targets", [])
    ]


def variable_queries(model: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Each ``label_values(series, label)`` variable as a query whose series must carry the label."""
    found = []
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert match, variable["definition"]
            found.append((f"variable {variable['name']!r}", match[1], "{{" + match[2] + "}}"))
    return found


def concrete(expr: str) -> str:
    """The expression as Prometheus takes it: Grafana's variables replaced by what they stand for."""
    for variable, replacement in VARIABLES.items():
        expr = expr.replace(variable, replacement)
    return expr


def _strings_out(expr: str) -> str:
    """The expression with every string literal blanked, its length kept (positions still match)."""
    return re.sub(
        r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`',
        lambda m: m.group(0)[0] + "_" * (len(m.group(0)) - 2) + m.group(0)[-1],
        expr,
    )


def metric_names(expr: str) -> set[str]:
    """The ttsq series an expression reads (label values and matchers aside)."""
    return set(re.findall(r"\bttsq_[A-Za-z0-9_]+", re.sub(r"\{[^}]*\}", "", _strings_out(expr))))


_BINARY = re.compile(r"==|!=|>=|<=|>|<|\b(?:and|or|unless)\b")
_MODIFIERS = re.compile(
    r"^\s*(?:bool\s+)?(?:(?:on|ignoring)\s*\([^)]*\)\s*)?(?:group_(?:left|right)\s*(?:\([^)]*\))?)?"
)
_ABSENT = re.compile(r"^absent(?:_over_time)?\s*\((.*)\)$", re.S)


def operands(expr: str) -> list[str]:
    """The parts of an alert expression that must hold data for it to mean anything: the sides of its
    top-level comparisons and set operators (an alert that does not fire returns nothing, its operands
    still do), with ``absent(x)`` read as ``x`` and number literals left out."""
    parts, depth, start, i, text = [], 0, 0, 0, _strings_out(expr)
    while i < len(text):
        char = text[i]
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0 and (match := _BINARY.match(text, i)):
            parts.append(expr[start:i])
            i = start = match.end()
            continue
        i += 1
    parts.append(expr[start:])
    found = []
    for part in parts:
        part = _MODIFIERS.sub("", part, count=1).strip()
        if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?", part):
            continue
        absent = _ABSENT.match(part)
        found.extend(operands(absent.group(1)) if absent else [part])
    return found


def nvml_gpus() -> bool:
    """Whether a worker on this machine would see a GPU through NVML (the GPU series exist)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return bool(pynvml.nvmlDeviceGetCount() > 0)
    except Exception:
        return False


# -- the real tools ------------------------------------------------------------------------------


def tool(name: str) -> str:
    """A Prometheus binary (``.ci/run`` installs Debian's ``prometheus`` package, which brings both)."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        missing_tool(f"no {name}: apt-get install prometheus (.ci/run does)")
    return found


class Prometheus:
    """Debian's Prometheus on a free loopback port, its data in the test's own folder."""

    def __init__(self, config: dict[str, Any], folder: Path) -> None:
        folder.mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config_path = folder / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
        self.log_path = folder / "prometheus.log"
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    tool("prometheus"),
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start:\n{self.log()}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """An HTTP API answer, errors included (a query that does not parse is a 400 with a JSON body)."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                answer: dict[str, Any] = json.loads(response.read())
        except urllib.error.HTTPError as error:
            answer = json.loads(error.read())
        return answer

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The series an instant query returns; AssertionError with Prometheus's message if it fails."""
        answer = self.api("query", query=expr)
        if answer["status"] != "success":
            raise AssertionError(f"{answer.get('errorType')}: {answer.get('error')}")
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    def names(self) -> set[str]:
        return set(self.api("label/__name__/values")["data"])

    def alerts(self) -> dict[str, list[dict[str, Any]]]:
        """Active alerts (pending or firing) by name."""
        found: dict[str, list[dict[str, Any]]] = {}
        for alert in self.api("alerts")["data"]["alerts"]:
            found.setdefault(alert["labels"]["alertname"], []).append(alert)
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        stop_process(self.process)


def problems(
    prometheus: Prometheus,
    panel_targets: list[tuple[str, str, str]],
    alert_exprs: list[Query],
    *,
    excepted: frozenset[str] = frozenset(),
    patience_s: float = 0.0,
) -> tuple[list[str], list[str]]:
    """What is wrong with these queries against this Prometheus, and which were skipped as excepted.

    A panel's query must parse, read only series Prometheus has, and return series that carry every
    label its legend names. An alert's expression must parse and read only series Prometheus has, and
    each of its operands must return series (the expression itself returns nothing while it does not fire).
    An empty answer is asked again for ``patience_s``: one scrape that ran past its timeout on a busy
    machine marks a target's series stale until the next.
    """
    known = prometheus.names()
    wrong: list[str] = []
    skipped: list[str] = []
    checks = [(where, expr, legend, False) for where, expr, legend in panel_targets]
    checks += [(where, expr, "", True) for where, expr in alert_exprs]
    for where, raw, legend, alert in checks:
        expr = concrete(raw)
        if "$" in expr:
            wrong.append(f"{where}: a variable Prometheus cannot know in {expr!r}")
            continue
        names = metric_names(expr)
        if names & excepted:
            skipped.append(where)
            continue
        if names - known:
            wrong.append(f"{where}: no series named {', '.join(sorted(names - known))}")
        try:
            prometheus.query(expr)
            for part in operands(expr) if alert else [expr]:
                result, until = prometheus.query(part), time.monotonic() + patience_s
                while not result and time.monotonic() < until:
                    time.sleep(0.5)
                    result = prometheus.query(part)
                if not result:
                    wrong.append(f"{where}: no series for {part!r}")
                for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
                    if not all(series["metric"].get(label) for series in result):
                        wrong.append(f"{where}: the legend's {label} is not a label of {part!r}")
        except AssertionError as error:
            wrong.append(f"{where}: {error}")
    return wrong, skipped


# -- the files themselves ------------------------------------------------------------------------


def test_the_dashboard_is_a_grafana_model_with_a_data_source_variable() -> None:
    model = dashboard()
    assert model["uid"] == "ttsq-overview" and isinstance(model["schemaVersion"], int) and model["id"] is None
    (source,) = model["__inputs"]
    assert (source["name"], source["type"], source["pluginId"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    variables = {variable["name"]: variable for variable in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"  # what an import fills in
    assert variables["queue"]["datasource"]["uid"] == "${datasource}"
    ids = [panel["id"] for panel in panels(model)]
    assert len(ids) == len(set(ids))
    for panel in panels(model):
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}" and target["expr"].strip(), panel["title"]
            # Only variables this dashboard declares, or Grafana's own.
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= {*variables, "__rate_interval", "__interval"}, (panel["title"], used)
    # What the issue asked the dashboard to show, each a panel.
    titles = {panel["title"] for panel in panels(model)}
    for wanted in (
        "Queue depth",
        "Queue wait",
        "Jobs/s by outcome",
        "Synthesis time per batch",
        "Batch size",
        "Audio seconds per second",
        "Real-time factor",
        "Cache hit ratio (workers)",
        "GPU utilization",
        "GPU memory",
        "Dead letters",
        "Parked jobs",
        "Latency by route",
        "Requests/s by status",
    ):
        assert wanted in titles
    # Every series the GPU exception covers is still read by some query: the list is not stale.
    read = set().union(*(metric_names(expr) for _, expr, _ in panel_queries(model)))
    assert read >= GPU_SERIES


def heading_slugs(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)
    }


def test_every_alert_says_what_it_means_and_where_its_runbook_is() -> None:
    headings = heading_slugs(OBSERVABILITY)
    names = [rule["alert"] for rule in rules()]
    assert len(names) == len(set(names)) == 7
    for rule in rules():
        notes = rule["annotations"]
        assert notes["summary"] and notes["description"], rule["alert"]
        page, _, anchor = notes["runbook"].partition("#")
        assert (ROOT / page).resolve() == OBSERVABILITY.resolve() and anchor in headings, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_promtool_checks_the_rules_and_the_compose_config() -> None:
    promtool = tool("promtool")
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 7 rules found" in checked.stdout, checked.stdout + checked.stderr
    # The compose config loads the rules (relative to itself) and passes as a whole.
    config = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS_CONFIG)], capture_output=True, text=True, timeout=60
    )
    assert config.returncode == 0 and "1 rule files found" in config.stdout, config.stdout + config.stderr


def test_promtool_unit_tests_every_alert() -> None:
    cases = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))["tests"]
    tested = {test["alertname"] for case in cases for test in case["alert_rule_test"]}
    assert tested == {rule["alert"] for rule in rules()}
    out = subprocess.run(
        [tool("promtool"), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_operands_are_the_sides_of_comparisons_and_set_operators() -> None:
    assert operands("absent(ttsq_worker_info)") == ["ttsq_worker_info"]
    assert operands('max by (queue) (x{queue=~"a|b>c"}) > 10\nand\nmax by (queue) (deriv(y[10m])) > 0') == [
        'max by (queue) (x{queue=~"a|b>c"})',
        "max by (queue) (deriv(y[10m]))",
    ]
    assert operands("a / on (i) group_left (n) b >= bool 0.5") == ["a / on (i) group_left (n) b"]
    assert operands("sum(rate(x[5m])) unless ignoring (le) y == 1e3") == ["sum(rate(x[5m]))", "y"]


def test_the_broker_up_gauge_is_zero_when_redis_is_unreachable() -> None:
    """``ttsq_broker_up``, the series of TTSQRedisUnreachable: a worker's Redis client facing a closed port."""
    closed = connect(f"redis://127.0.0.1:{free_port()}/0")  # the client a worker builds, no server behind it
    metrics = Metrics(node="probe@test", queues=["ttsq"], broker=closed)
    port = metrics.serve(0, "127.0.0.1")
    try:
        samples = scrape(port)
        assert value(samples, "ttsq_broker_up") == 0
        assert not any(name == "ttsq_queue_depth" for name, _ in samples)
    finally:
        metrics.close()
        closed.close()


# -- against a real Prometheus -------------------------------------------------------------------


def serve_traffic(settings: Settings, gateway: GatewayProcess) -> None:
    """Jobs through the gateway and the producer, a producer cache hit, a worker cache hit, HTTP errors
    (401, 400, 404), a message no worker runs (a dead letter) and a job whose attempts ran out (parked)."""
    token = api_key(settings)
    speech = {"model": "tts-1", "voice": "alloy", "response_format": "wav"}
    with httpx.Client(base_url=gateway.url, timeout=120) as http:
        auth = {"Authorization": f"Bearer {token}"}
        for n in range(2):
            first = http.post("/v1/audio/speech", json={**speech, "input": f"{SECRET}, gateway {n}."}, headers=auth)
            assert first.status_code == 200, first.text
        again = http.post("/v1/audio/speech", json={**speech, "input": f"{SECRET}, gateway 0."}, headers=auth)
        assert again.status_code == 200 and again.headers["x-ttsq-cached"] == "true"
        assert http.post("/v1/audio/speech", json={**speech, "input": "Hello."}).status_code == 401
        bad = http.post("/v1/audio/speech", json={**speech, "input": "Hello.", "speed": 1.5}, headers=auth)
        assert bad.status_code == 400
        assert http.get(f"/v1/jobs/{uuid.uuid4()}", headers=auth).status_code == 404

    client = Client(settings)
    app = make_app(settings)
    try:
        for job in [client.submit(f"{SECRET}, producer {n}.") for n in range(3)]:
            assert job.wait(timeout=120)["duration_s"] > 0
        # A raw send, as a web backend does: the worker's own cache re-check finds it.
        cached = app.send_task("ttsq.synthesize", kwargs={"text": f"{SECRET}, producer 0."}, queue=settings.queue)
        assert cached.get(timeout=120)["cached"]
        app.send_task("ttsq.no_such_task", kwargs={}, queue=settings.queue)  # the envelope gate refuses it
        # A job that crashed or hung its workers TTSQ_MAX_ATTEMPTS times, as its record in Redis says.
        parked_id = str(uuid.uuid4())
        for _ in range(settings.max_attempts):
            client.redis.attempts.charge(parked_id)
        parked = app.send_task(
            "ttsq.synthesize", kwargs={"text": f"{SECRET}, parked."}, task_id=parked_id, queue=settings.queue
        )
        parked.get(timeout=120, propagate=False)
        assert parked.state == "FAILURE" and "parked" in str(parked.result)
    finally:
        app.close()
        client.close()


def wait_for(prometheus: Prometheus, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{prometheus.log()[-3000:]}")
        time.sleep(0.5)


@pytest.mark.slow
def test_every_panel_and_alert_reads_data_from_a_real_prometheus(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway, tmp_path: Path
) -> None:
    settings = settings.replace(metrics_port=free_port())
    start_worker(settings)
    gateway = start_gateway(settings)
    # A worker's metrics facing a Redis that is down: the condition of TTSQRedisUnreachable, produced.
    closed = connect(f"redis://127.0.0.1:{free_port()}/0")
    unreachable = Metrics(node="unreachable@test", queues=[settings.queue], broker=closed)
    unreachable_port = unreachable.serve(0, "127.0.0.1")
    config = {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": "ttsq-workers", "static_configs": [{"targets": [f"127.0.0.1:{settings.metrics_port}"]}]},
            {"job_name": "ttsq-gateway", "static_configs": [{"targets": [f"127.0.0.1:{gateway.port}"]}]},
            {"job_name": "ttsq-redis-down", "static_configs": [{"targets": [f"127.0.0.1:{unreachable_port}"]}]},
        ],
    }
    prometheus = Prometheus(config, tmp_path / "prometheus")
    try:
        # Counters seen at zero first, so that what the traffic adds is an increase.
        wait_for(prometheus, lambda: len(prometheus.query("up == 1")) == 3, "all three targets up")
        wait_for(prometheus, lambda: bool(prometheus.query("ttsq_worker_info")), "the worker's model in its info")
        serve_traffic(settings, gateway)
        wait_for(
            prometheus,
            lambda: (
                bool(prometheus.query('ttsq_jobs_total{outcome="cached"} > 0'))
                and bool(prometheus.query("ttsq_parked_jobs_total > 0"))
                and bool(prometheus.query('ttsq_gateway_requests_total{status="404"}'))
            ),
            "the traffic in Prometheus",
        )
        # The conditions produced raise their alerts; a healthy fleet raises none of the others.
        wait_for(
            prometheus,
            lambda: {"TTSQDeadLetters", "TTSQJobsParked", "TTSQRedisUnreachable"} <= set(prometheus.alerts()),
            "the alerts of the conditions produced",
        )
        alerts = prometheus.alerts()
        assert set(alerts) == {"TTSQDeadLetters", "TTSQJobsParked", "TTSQRedisUnreachable"}
        assert [a["labels"]["reason"] for a in alerts["TTSQDeadLetters"]] == ["unknown task"]
        assert [a["labels"]["instance"] for a in alerts["TTSQRedisUnreachable"]] == [f"127.0.0.1:{unreachable_port}"]
        assert all("<no value>" not in json.dumps(a["annotations"]) for found in alerts.values() for a in found)

        excepted = frozenset() if nvml_gpus() else GPU_SERIES
        targets = panel_queries(dashboard()) + variable_queries(dashboard())
        expressions = [(f"alert {rule['alert']}", rule["expr"]) for rule in rules()]
        wrong, skipped = problems(prometheus, targets, expressions, excepted=excepted, patience_s=5)
        assert wrong == [], "\n".join(wrong)
        # Skipped: exactly the queries of GPU series, and only where there is no GPU.
        assert skipped == [where for where, expr, _ in targets if metric_names(expr) & excepted] + [
            where for where, expr in expressions if metric_names(expr) & excepted
        ]
        assert len(skipped) == (0 if not excepted else 4)

        # The checker can fail: a misspelt series (alone, or hidden behind `or vector(0)`), a query that
        # does not parse, a legend naming a label the series lacks, an alert operand with no data.
        wrong, _ = problems(
            prometheus,
            [
                ("misspelt", "sum(rate(ttsq_job_total[$__rate_interval]))", ""),
                ("hidden", "sum(ttsq_jobs_totl) or vector(0)", ""),
                ("unparsed", "sum(rate(ttsq_jobs_total[$__rate_interval])", ""),
                ("legend", "sum by (outcome) (rate(ttsq_jobs_total[$__rate_interval]))", "{{queue}}"),
                ("variable", 'ttsq_queue_depth{queue=~"$tenant"}', ""),
            ],
            [("alert", 'sum(increase(ttsq_dead_letters_total{reason="nope"}[10m])) > 0')],
        )
        assert [line.split(":")[0] for line in wrong] == [
            "misspelt",
            "misspelt",
            "hidden",
            "unparsed",
            "legend",
            "variable",
            "alert",
        ], wrong
    finally:
        prometheus.stop()
        unreachable.close()
        closed.close()
