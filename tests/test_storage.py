"""One contract, every storage backend: local folder and a real S3-compatible server (moto)."""

from __future__ import annotations

import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import BUCKET

from ttsq.config import Settings
from ttsq.errors import StorageError
from ttsq.storage import LocalStorage, S3Storage, Storage, open_storage


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield LocalStorage(tmp_path / "store")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        yield S3Storage(BUCKET, f"contract-{uuid.uuid4().hex[:8]}", endpoint_url=endpoint, region="us-east-1")


def fetch(url: str) -> tuple[bytes, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read(), response.headers.get("Content-Type", "")


def test_put_get_and_fetch_by_url(storage: Storage) -> None:
    key = f"audio/ab/{uuid.uuid4().hex}.wav"
    assert not storage.exists(key)
    assert storage.put(key, b"RIFF-bytes", "audio/wav") is True
    assert storage.exists(key)
    assert storage.get(key) == b"RIFF-bytes"
    body, content_type = fetch(storage.url(key, 60))
    assert body == b"RIFF-bytes"
    if isinstance(storage, S3Storage):
        assert content_type == "audio/wav"


def test_put_is_idempotent(storage: Storage) -> None:
    key = f"audio/cd/{uuid.uuid4().hex}.mp3"
    assert storage.put(key, b"first", "audio/mpeg") is True
    assert storage.put(key, b"first", "audio/mpeg") is False
    assert storage.get(key) == b"first"


def test_put_file_stores_a_large_file_in_parts_and_is_idempotent(storage: Storage, tmp_path: Path) -> None:
    # Past boto3's multipart threshold (8 MiB): S3 gets it as a multipart upload; read from the start
    # whatever the handle's position.
    data = os.urandom(1024) * (9 * 1024 + 7)
    key = f"audio/ef/{uuid.uuid4().hex}.wav"
    with (tmp_path / "big.wav").open("w+b") as handle:
        handle.write(data)
        assert storage.put_file(key, handle, "audio/wav") is True
        assert storage.put_file(key, handle, "audio/wav") is False
    assert storage.get(key) == data
    if isinstance(storage, S3Storage):
        assert fetch(storage.url(key, 60))[1] == "audio/wav"
    else:
        assert not [p for p in (tmp_path / "store").rglob(".partial-*")]


def test_missing_object_is_a_storage_error(storage: Storage) -> None:
    with pytest.raises(StorageError):
        storage.get("audio/00/missing.wav")


def test_presigned_url_carries_the_configured_expiry(s3_endpoint: str) -> None:
    storage = S3Storage(BUCKET, "expiry", endpoint_url=s3_endpoint, region="us-east-1")
    assert "X-Amz-Expires=1234" in storage.url("audio/ab/x.wav", 1234)


@pytest.mark.parametrize("key", ["../escape.wav", "a/../../escape.wav", "/tmp/escape.wav", "a/..", "", "."])
def test_local_storage_refuses_keys_outside_its_folder(tmp_path: Path, key: str) -> None:
    store = LocalStorage(tmp_path / "store")
    with pytest.raises(StorageError, match="escapes the storage folder"):
        store.put(key, b"x", "audio/wav")
    assert not (tmp_path / "escape.wav").exists()
    store.put("a/../audio/ab/fine.wav", b"x", "audio/wav")  # inside, however it is spelled
    assert (tmp_path / "store" / "audio" / "ab" / "fine.wav").read_bytes() == b"x"


def test_local_storage_leaves_no_partial_files(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.put("audio/ef/one.wav", b"x" * 1000, "audio/wav")
    assert [p.name for p in (tmp_path / "audio" / "ef").iterdir()] == ["one.wav"]


def test_unreachable_s3_is_a_storage_error() -> None:
    from ttsq.ops.redis_server import free_port

    storage = S3Storage(BUCKET, "", endpoint_url=f"http://127.0.0.1:{free_port()}", region="us-east-1")
    with pytest.raises(StorageError):
        storage.put("audio/aa/x.wav", b"x", "audio/wav")


def test_open_storage_follows_the_url(tmp_path: Path) -> None:
    assert isinstance(open_storage(Settings(storage_url=str(tmp_path))), LocalStorage)
    assert isinstance(open_storage(Settings(storage_url=f"file://{tmp_path}")), LocalStorage)
    assert isinstance(
        open_storage(Settings(storage_url="s3://bucket/p", s3_endpoint_url="http://127.0.0.1:1")), S3Storage
    )
    with pytest.raises(StorageError):
        open_storage(Settings(storage_url="ftp://host/x"))


def test_presigned_urls_use_the_public_endpoint_when_set(s3_endpoint: str) -> None:
    storage = S3Storage(
        BUCKET, "public", endpoint_url=s3_endpoint, region="us-east-1", public_endpoint_url="http://localhost:9000"
    )
    assert storage.url("audio/ab/x.wav", 60).startswith("http://localhost:9000/ttsq-test/public/audio/ab/x.wav?")
    storage.put("audio/ab/x.wav", b"x", "audio/wav")  # uploads still go to the private endpoint
    assert storage.exists("audio/ab/x.wav")


def test_stream_reads_the_object_in_pieces(storage: Storage) -> None:
    key = f"audio/12/{uuid.uuid4().hex}.wav"
    data = bytes(range(256)) * 1000
    storage.put(key, data, "audio/wav")
    pieces = list(storage.stream(key, chunk_bytes=10_000))
    assert b"".join(pieces) == data and len(pieces) == 26
    with pytest.raises(StorageError):
        list(storage.stream("audio/00/missing.wav"))


def test_keys_list_a_prefix_and_delete_removes(storage: Storage) -> None:
    prefix = f"voices-{uuid.uuid4().hex[:6]}/"
    for name in ("b.wav", "a.wav", "a.json"):
        storage.put(prefix + name, b"x", "audio/wav")
    storage.put(f"audio/34/{uuid.uuid4().hex}.wav", b"x", "audio/wav")
    assert storage.keys(prefix) == [prefix + "a.json", prefix + "a.wav", prefix + "b.wav"]
    assert storage.delete(prefix + "a.wav") is True
    assert storage.delete(prefix + "a.wav") is False
    assert storage.keys(prefix) == [prefix + "a.json", prefix + "b.wav"]
    assert not storage.exists(prefix + "a.wav")
