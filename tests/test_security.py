"""Redis with a password and TLS, through ``rediss://`` URLs only: producer, worker, cache index."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support import WorkerProcess

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.redis_server import free_port, redis_server_executable

StartWorker = Callable[..., WorkerProcess]
PASSWORD = "s3cret-for-tls-test"


def write_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ttsq test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.pem", folder / "redis.pem", folder / "redis.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    ca, cert, key = write_certificates(tmp_path)
    port = free_port()
    log = tmp_path / "redis-tls.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                redis_server_executable(),
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(cert),
                "--tls-key-file",
                str(key),
                "--tls-ca-cert-file",
                str(ca),
                "--tls-auth-clients",
                "no",
                "--requirepass",
                PASSWORD,
                "--save",
                "",
                "--dir",
                str(tmp_path),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={ca}"
        deadline = time.monotonic() + 10
        while True:
            if process.poll() is not None:
                message = f"this redis-server has no TLS support: {log.read_text(errors='replace')[-300:]}"
                if os.environ.get("CI") == "true":
                    pytest.fail(message)
                pytest.skip(message)
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield port, ca
    finally:
        process.terminate()
        process.wait(10)


def test_redis_with_password_and_tls_works_through_rediss_urls(
    settings: Settings, start_worker: StartWorker, tls_redis: tuple[int, Path]
) -> None:
    port, ca = tls_redis
    tls = f"ssl_cert_reqs=required&ssl_ca_certs={ca}"
    base = f"rediss://:{PASSWORD}@127.0.0.1:{port}"
    secure = settings.replace(
        broker_url=f"{base}/0?{tls}", result_backend=f"{base}/1?{tls}", cache_url=f"{base}/2?{tls}"
    )
    # The server really demands both: no password, or no TLS, gets nowhere.
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0?{tls}").ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", socket_timeout=2).ping()

    worker = start_worker(secure)
    with Client(secure) as client:
        result = client.submit("Spoken over TLS.").wait(timeout=60)
        assert result["duration_s"] > 0
        assert client.submit("Spoken over TLS.").wait(timeout=30)["cached"] is True  # the cache index, over TLS
    assert worker.stop() == 0
    assert PASSWORD not in worker.log()
