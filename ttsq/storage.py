"""Where audio lives: S3-compatible object storage, or a local folder.

Both implementations keep one promise: ``put`` is idempotent, because a key always names the same
audio (it is a content hash). A redelivered job therefore rewrites nothing, and an object is either
absent or whole: S3 PUT is atomic per object and the local store writes to a temporary file and
renames it into place.

URLs are made when asked for (presigned with an expiry), never stored, so a stale URL can always be
refreshed from the key.

Every S3 call is tried ``TTSQ_STORAGE_ATTEMPTS`` times. Between tries the pause doubles from
``TTSQ_STORAGE_BACKOFF_MS`` (capped at 30 s) with "equal jitter": half the pause is fixed and half
random, so workers that lost the store together do not come back in lockstep, and the total retry
window has a known minimum. A refusal that another try cannot change (a 4xx such as AccessDenied)
fails at once.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from ttsq.errors import ConfigError, StorageError

if TYPE_CHECKING:
    from ttsq.config import Settings

logger = logging.getLogger(__name__)


#: Pieces ``stream`` reads at a time.
STREAM_CHUNK_BYTES = 64 * 1024


class Storage(Protocol):
    """An object store addressed by keys like ``audio/ab/ab12....wav``."""

    def put(self, key: str, data: bytes, content_type: str) -> bool:
        """Store ``data`` under ``key`` unless it is already there; return True if written."""
        ...

    def put_file(self, key: str, handle: IO[bytes], content_type: str) -> bool:
        """``put`` from a seekable binary file, read from its start: a large file goes up in parts
        and never whole in memory."""
        ...

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        ...

    def get(self, key: str) -> bytes:
        """The stored bytes; ``StorageError`` if absent."""
        ...

    def url(self, key: str, expires_s: int) -> str:
        """A URL a client can fetch the object from for at least ``expires_s`` seconds."""
        ...

    def stream(self, key: str, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[bytes]:
        """The stored bytes in pieces, as they are read (an HTTP response sends them on at once);
        ``StorageError`` if absent, raised before the first piece."""
        ...

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix`` (``voices/``, say), sorted."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the object under ``key``; False if there was none."""
        ...

    def check(self) -> None:
        """Return if the store is there and answers (one try, for probes): ``ConfigError`` naming
        ``TTSQ_STORAGE_URL`` when it does not exist or refuses us, ``StorageError`` when it cannot be
        reached."""
        ...


class LocalStorage:
    """A folder on this machine; URLs are ``file://`` URLs. For one machine and the embedded mode."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        self._inside = os.path.join(str(self.root), "")  # the root, with its separator: what a path starts with

    def _path(self, key: str) -> Path:
        # Keys come from content hashes, but a store must not write outside its root whatever it is given.
        # Resolved as text (``..``, an absolute key), not on the disk: a walk of every folder on the way
        # (``Path.resolve``) was a twentieth of a worker's Python time a job on the embedded default.
        path = os.path.normpath(os.path.join(self._inside, key))
        if not path.startswith(self._inside):
            raise StorageError(f"object key escapes the storage folder: {key!r}")
        return Path(path)

    def put(self, key: str, data: bytes, content_type: str) -> bool:
        return self._write(key, lambda handle: handle.write(data))

    def put_file(self, key: str, handle: IO[bytes], content_type: str) -> bool:
        def copy(target: IO[bytes]) -> None:
            handle.seek(0)
            shutil.copyfileobj(handle, target, STREAM_CHUNK_BYTES * 16)

        return self._write(key, copy)

    def _write(self, key: str, write: Callable[[IO[bytes]], object]) -> bool:
        path = self._path(key)
        if path.exists():
            return False
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
            try:
                with os.fdopen(fd, "wb") as target:
                    write(target)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise StorageError(f"cannot write {key} under {self.root}: {exc.strerror}") from exc
        return True

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read {key} under {self.root}: {exc.strerror}") from exc

    def url(self, key: str, expires_s: int) -> str:
        return self._path(key).as_uri()

    def stream(self, key: str, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[bytes]:
        try:
            handle = self._path(key).open("rb")
        except OSError as exc:
            raise StorageError(f"cannot read {key} under {self.root}: {exc.strerror}") from exc
        return _pieces(handle, chunk_bytes)

    def keys(self, prefix: str) -> list[str]:
        folder = self.root / prefix.rstrip("/") if prefix.endswith("/") else self.root
        if not folder.is_dir():
            return []
        return sorted(
            key
            for path in folder.rglob("*")
            if path.is_file()
            and not path.name.startswith(".partial-")
            and (key := path.relative_to(self.root).as_posix()).startswith(prefix)
        )

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot delete {key} under {self.root}: {exc.strerror}") from exc
        return True

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)  # as the first ``put`` would
        except OSError as exc:
            raise ConfigError("TTSQ_STORAGE_URL", f"cannot use the folder {self.root}: {exc.strerror}") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError("TTSQ_STORAGE_URL", f"the folder {self.root} is not writable")


class S3Storage:
    """S3, MinIO, R2 or any S3-compatible store, through boto3."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str = "",
        region: str = "",
        public_endpoint_url: str = "",
        attempts: int = 3,
        backoff_s: Callable[[int], float] | None = None,
        timeout_s: float = 10,
    ) -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.attempts = attempts
        self.backoff_s = backoff_s or (lambda retry: min(30.0, 0.5 * 2**retry))
        config = Config(
            signature_version="s3v4",
            # Path-style addressing is what MinIO and most S3-compatible servers expect.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            # ttsq's own loop does the retrying (bounded, jittered, counted in the visibility budget).
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
        )
        # Credentials come from boto3's chain (environment, shared config, instance role), never
        # from ttsq settings, task arguments or results.
        self._client: Any = boto3.client(
            "s3", endpoint_url=endpoint_url or None, region_name=region or None, config=config
        )
        # Presigning is offline; a second client signs for the address clients use, when it differs.
        self._signer: Any = (
            self._client
            if not public_endpoint_url
            else boto3.client("s3", endpoint_url=public_endpoint_url, region_name=region or None, config=config)
        )

    def put(self, key: str, data: bytes, content_type: str) -> bool:
        if self.exists(key):
            return False
        self._call("put_object", Key=self.prefix + key, Body=data, ContentType=content_type)
        return True

    def put_file(self, key: str, handle: IO[bytes], content_type: str) -> bool:
        if self.exists(key):
            return False
        from boto3.s3.transfer import TransferConfig

        # boto3's managed transfer: a multipart upload once the file passes its threshold (8 MiB), two
        # parts in memory at a time. A multipart object appears whole at completion, as a PUT does.
        self._call(
            "upload_fileobj",
            before=lambda: handle.seek(0),
            Fileobj=handle,
            Key=self.prefix + key,
            ExtraArgs={"ContentType": content_type},
            Config=TransferConfig(max_concurrency=2),
        )
        return True

    def exists(self, key: str) -> bool:
        try:
            self._call("head_object", Key=self.prefix + key)
        except _Absent:
            return False
        return True

    def get(self, key: str) -> bytes:
        response = self._call("get_object", Key=self.prefix + key)
        body: bytes = response["Body"].read()
        return body

    def stream(self, key: str, chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[bytes]:
        body = self._call("get_object", Key=self.prefix + key)["Body"]
        return _pieces(body, chunk_bytes)

    def keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        token: dict[str, Any] = {}
        while True:
            page = self._call("list_objects_v2", Prefix=self.prefix + prefix, **token)
            keys += [item["Key"][len(self.prefix) :] for item in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return sorted(keys)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def delete(self, key: str) -> bool:
        if not self.exists(key):
            return False
        self._call("delete_object", Key=self.prefix + key)
        return True

    def check(self) -> None:
        from botocore.exceptions import ClientError

        where = f"s3://{self.bucket} at {self._client.meta.endpoint_url}"
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = exc.response.get("Error", {}).get("Code")
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                raise ConfigError("TTSQ_STORAGE_URL", f"the bucket {where} does not exist") from None
            if status == 403:
                # The bucket exists; HEAD on it needs s3:ListBucket, which a key allowed only to get and
                # put objects under its prefix lacks. Its first put says whether it may write.
                return
            if 400 <= status < 500 and status not in (408, 429):
                raise ConfigError(
                    "TTSQ_STORAGE_URL", f"the bucket {where} refused us: {code} (HTTP {status})"
                ) from None
            raise StorageError(f"the bucket {where} did not answer: {code} (HTTP {status})") from exc
        except Exception as exc:  # botocore raises many unrelated types for one outage
            raise StorageError(f"cannot reach the bucket {where}: {type(exc).__name__}: {exc}") from exc

    def url(self, key: str, expires_s: int) -> str:
        url: str = self._signer.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self.prefix + key}, ExpiresIn=expires_s
        )
        return url

    def _call(self, method: str, *, before: Callable[[], object] | None = None, **params: Any) -> Any:
        """One S3 call, tried up to ``attempts`` times (``before`` runs before each try); ``StorageError``
        once they run out."""
        from botocore.exceptions import ClientError

        started = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                if before is not None:
                    before()
                return getattr(self._client, method)(Bucket=self.bucket, **params)
            except ClientError as exc:
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                code = exc.response.get("Error", {}).get("Code")
                if method == "head_object" and code in ("404", "NoSuchKey", "NotFound"):
                    raise _Absent from None
                if 400 <= status < 500 and status not in (408, 429):  # another try cannot change a refusal
                    raise StorageError(f"s3 {method} {params.get('Key', '')}: {exc}") from exc
                error: Exception = exc
            except Exception as exc:  # botocore raises many unrelated types for one outage
                error = exc
            if attempt == self.attempts:
                raise StorageError(
                    f"s3 {method} {params.get('Key', '')}: gave up after {attempt} tries in "
                    f"{time.monotonic() - started:.1f}s: {error}"
                ) from error
            cap = self.backoff_s(attempt - 1)
            pause = cap / 2 + random.uniform(0, cap / 2)  # equal jitter
            logger.warning(
                "s3 %s failed (try %d of %d: %s); trying again in %.2fs",
                method,
                attempt,
                self.attempts,
                type(error).__name__,
                pause,
            )
            time.sleep(pause)
        raise AssertionError("unreachable")


def _pieces(handle: Any, chunk_bytes: int) -> Iterator[bytes]:
    """Read ``handle`` piece by piece, closing it at the end (or when the reader stops early)."""
    try:
        while piece := handle.read(chunk_bytes):
            yield piece
    finally:
        handle.close()


class _Absent(Exception):
    """head_object found no object (not an error: ``exists`` answers False)."""


def open_storage(settings: Settings) -> Storage:
    """The store named by ``TTSQ_STORAGE_URL``."""
    url = settings.storage_url
    if url.startswith("s3://"):
        parsed = urlparse(url)
        return S3Storage(
            parsed.netloc,
            parsed.path,
            endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region,
            public_endpoint_url=settings.s3_public_endpoint_url,
            attempts=settings.storage_attempts,
            backoff_s=settings.storage_backoff_s,
            timeout_s=settings.storage_timeout_s,
        )
    if url.startswith("file://"):
        return LocalStorage(urlparse(url).path)
    if "://" in url:
        raise StorageError(f"unsupported storage URL scheme in {url!r}; use s3://bucket/prefix or a folder")
    return LocalStorage(url)
