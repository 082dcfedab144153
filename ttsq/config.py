"""Settings: one frozen object, read from ``TTSQ_*`` environment variables once per entrypoint.

Nothing in ttsq reads the environment at import time. Entrypoints call ``Settings.from_env()``
(optionally with overrides from command-line flags) and pass the object down. A malformed value is a
``ConfigError`` that names the variable, raised before anything connects or loads.

S3 credentials are deliberately *not* settings: boto3's own chain (environment, shared config,
instance role) supplies them, so they never travel in task arguments or results.

Why one file over 400 lines: every field is documented where it is declared (docs/configuration.md is
generated from these comments) and checked in the one ``__post_init__``; the ``sentinel://`` URL form is
taken apart here too, so the startup check and the clients (``ttsq.records.connection``, ``ttsq.app``)
read it the same way.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urlsplit

from ttsq.constants import (
    DEFAULT_QUEUE,
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_HEALTH_CHECK_INTERVAL_S,
    REDIS_SOCKET_TIMEOUT_S,
    TENANT_PATTERN,
)
from ttsq.errors import ConfigError

T = TypeVar("T")

ENV_PREFIX = "TTSQ_"
#: SigV4 presigned URLs cannot live longer than seven days.
MAX_URL_EXPIRY_S = 7 * 24 * 3600
#: The longest pause between two storage tries, however many tries are allowed.
MAX_STORAGE_BACKOFF_S = 30.0


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything a producer or worker needs to know, validated."""

    #: Celery broker: ``redis://``, ``rediss://`` for TLS (always with ``ssl_cert_reqs=required``), or
    #: ``unix://``; a password goes in the URL (``redis://:PASSWORD@host:6379/0``). Behind Sentinel:
    #: ``sentinel://host:26379;sentinel://host2:26379/0`` (every Sentinel, the database once, the data
    #: nodes' password in the first: ``sentinel://:PASSWORD@host:26379;...``) with TTSQ_REDIS_MASTER_NAME.
    broker_url: str = "redis://127.0.0.1:6379/0"
    #: Celery result backend (the same URL forms as the broker).
    result_backend: str = "redis://127.0.0.1:6379/1"
    #: Redis for the cache index, single-flight claims, engine identities, the attempt ledger and the
    #: fleet counters (the same URL forms as the broker).
    cache_url: str = "redis://127.0.0.1:6379/2"
    #: The name Sentinel monitors the primary under (``sentinel monitor NAME ...``); required when a Redis
    #: URL is ``sentinel://``, unused otherwise.
    redis_master_name: str = ""
    #: Username for the Sentinels themselves (Redis ACL), when they need one; the data nodes' credentials
    #: stay in the URL.
    sentinel_username: str = ""
    #: Password for the Sentinels themselves (their ``requirepass``); the data nodes' password stays in
    #: the URL. Empty: the Sentinels ask for none.
    sentinel_password: str = ""
    #: Replicas that must hold a producer's record of a job before its submit is accepted (Redis
    #: ``WAIT``); a submit whose record did not reach that many within TTSQ_REDIS_WAIT_TIMEOUT_MS fails
    #: with an error and nothing is queued. 0: accept once the primary has it (a failover can then lose
    #: the last accepted jobs). 1 or more with Sentinel: docs/high-availability.md.
    redis_wait_replicas: int = 0
    #: The longest a submit waits for TTSQ_REDIS_WAIT_REPLICAS replicas, in milliseconds.
    redis_wait_timeout_ms: int = 500
    #: The longest ttsq waits for any one answer from Redis, in seconds: a node that stopped answering
    #: (frozen, ``DEBUG SLEEP``, a partition) is given up after this and the call made again on a new
    #: connection (behind Sentinel: to the primary the Sentinels name then). Longer than the longest
    #: blocking read ttsq makes (1 s stream reads and broker polls) and than TTSQ_REDIS_WAIT_TIMEOUT_MS.
    redis_socket_timeout_s: int = REDIS_SOCKET_TIMEOUT_S
    #: The longest ttsq waits to open a connection to Redis, in seconds (a host that is down).
    redis_connect_timeout_s: int = REDIS_CONNECT_TIMEOUT_S
    #: How often, in seconds, a Redis connection proves it still leads somewhere before it is used again:
    #: an idle one is pinged, and behind Sentinel each connection asks the Sentinels which node is the
    #: primary (one question per connection per interval) and is dropped, for reads as for writes, once it
    #: is not that node. kombu's check of its waiting broker connections runs this often too.
    redis_health_check_s: int = REDIS_HEALTH_CHECK_INTERVAL_S
    #: ``s3://bucket/prefix`` or a local folder (a path or ``file://`` URL).
    storage_url: str = "./ttsq-audio"
    #: S3 endpoint, for MinIO, R2 and other S3-compatible stores; empty means AWS.
    s3_endpoint_url: str = ""
    #: Endpoint written into presigned URLs, when clients reach the store by another address than
    #: the workers do (compose: workers use http://minio:9000, users http://localhost:9000). Empty:
    #: the endpoint itself.
    s3_public_endpoint_url: str = ""
    #: S3 region; empty: boto3's own. Credentials always come from boto3's chain, never from settings.
    s3_region: str = ""
    #: Lifetime of presigned URLs, in seconds; at most 7 days (604800), the limit of SigV4.
    url_expiry_s: int = 3600
    #: How long a cache index entry lives, in seconds; 0: no expiry (kept until Redis evicts it).
    cache_ttl_s: int = 30 * 24 * 3600
    #: How long Celery keeps a task result, in seconds (at least 60).
    result_ttl_s: int = 24 * 3600
    #: Who shares cached audio and single flight: ``fleet`` (every tenant: an identical request is served
    #: from any tenant's audio, each under a job id of its own) or ``tenant`` (a tenant's requests share
    #: only its own; closes the side channel docs/security.md describes, at the cost of synthesizing the
    #: same audio once per tenant).
    cache_scope: str = "fleet"
    #: Engine: ``espeak`` (CPU), ``qwen`` (Qwen3-TTS), ``qwen-fast`` (the same checkpoints through ttsq's
    #: own decode loop), or ``package.module:Factory`` for an engine of your own (called with the settings).
    engine: str = "espeak"
    #: Word timestamps (docs/timestamps.md): the aligner for an engine that does not time its own words
    #: (espeak does): ``whisper`` (faster-whisper on the CPU, the extras ``fidelity`` and
    #: ``fidelity-multilingual``) or ``qwen-aligner`` (Qwen3-ForcedAligner-0.6B on ``TTSQ_QWEN_DEVICE``,
    #: the extra ``qwen``; its checkpoint is ``TTSQ_QWEN_ALIGNER_MODEL``).
    aligner: str = "whisper"
    #: qwen-aligner: a local Qwen3-ForcedAligner-0.6B checkpoint folder (config.json, safetensors,
    #: tokenizer and preprocessor files); required for ``TTSQ_ALIGNER=qwen-aligner``. Never downloaded.
    qwen_aligner_model: str = ""
    #: Queue of voice_design jobs; custom_voice and voice_clone jobs use ``<queue>.custom_voice`` and
    #: ``<queue>.voice_clone``.
    queue: str = DEFAULT_QUEUE
    #: Lanes and fair shares (docs/scheduling.md). Jobs of one queue a producer lets wait in Redis's list
    #: at once; while it holds this many, a new job waits in its tenant's place and workers release the
    #: tenants' jobs into the list in round robin. 0: every job goes straight to the list (no fair shares).
    release_window: int = 64
    #: The share of messages, in percent, a worker takes from the bulk lane while both lanes have work:
    #: interactive work goes first, and bulk work never starves.
    bulk_share_percent: int = 20
    #: Jobs each tenant releases per turn of the round robin, as ``name=weight,name=weight``; a tenant
    #: not named has weight 1.
    tenant_weights: str = ""
    #: The most jobs one tenant may have in flight (sent and not finished: in its queue's list, held by a
    #: worker, or running), on top of the fair shares; a job over it waits in its tenant's place until one
    #: of the tenant's jobs finishes. Producers and workers read it. 0: no cap.
    tenant_max_in_flight: int = 0
    #: Largest batch (1..256); worker concurrency (task threads) is twice this.
    max_batch: int = 8
    #: The longest a batch waits to fill after its first job, in milliseconds; it waits that long only
    #: while more jobs are coming (a lone job waits a quarter of it). qwen-fast does not wait.
    max_wait_ms: int = 200
    #: Redis redelivers an unacked job after this long, in seconds, even while it still runs; it must
    #: outlast what a healthy job can take (checked at start, see below).
    visibility_timeout_s: int = 3600
    #: How long a task thread waits for its batch (the batch ahead of it, then its own), in seconds;
    #: must stay well inside the visibility timeout.
    job_timeout_s: int = 600
    #: Longest one engine call may run, in seconds; past it the engine is taken for stuck and the worker
    #: process exits with status 70 so that its supervisor restarts it. 0 means half the job timeout. It
    #: must fit a full batch of the longest texts: a worker whose engine can say what a batch costs (the
    #: stand-in) refuses to start where it does not; for qwen, set it above a measured full batch.
    batch_timeout_s: int = 0
    #: Times one job may enter the engine without finishing (its worker died or hung each time)
    #: before it is failed and parked for an operator (``ttsq failed``, ``ttsq retry``). Keep it >= 2:
    #: the batch neighbours of a job that hangs are charged one attempt too.
    max_attempts: int = 3
    #: Seconds a job that no worker has received may stay so, once its queue has moved past it (a worker
    #: received a job accepted after it) or drained, before the sweeper takes its message for lost (kombu
    #: popped it and never recorded it: a Redis restart or a dropped connection) and sends it again under
    #: the same id. A job is sent again within about twice this after it was lost.
    lost_job_grace_s: int = 10
    #: Tries per storage call, with exponential backoff and jitter between them.
    storage_attempts: int = 3
    #: Backoff before the second try, in milliseconds; it doubles for each further try (capped at 30 s),
    #: with equal jitter.
    storage_backoff_ms: int = 500
    #: Connect and read timeout of each storage try, in seconds.
    storage_timeout_s: int = 10
    #: Longest text of one job, in characters after normalization.
    max_text_chars: int = 5000
    #: Longest voice description (``instruct``), in characters.
    max_instruct_chars: int = 1000
    #: Worker log level: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    #: Log lines of workers and the gateway: ``text`` (one readable line) or ``json`` (one object per line,
    #: with ``trace_id`` and ``span_id`` when written inside a traced job or request; docs/observability.md).
    log_format: str = "text"
    # The qwen engine (TTSQ_ENGINE=qwen). The model is a local folder: workers never download.
    #: qwen: a local Qwen3-TTS checkpoint folder (VoiceDesign, CustomVoice or Base), with
    #: ``speech_tokenizer/``; required. Workers never download weights.
    qwen_model: str = ""
    #: qwen: ``auto`` (cuda:0 when CUDA is available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
    qwen_device: str = "auto"
    #: qwen: ``auto`` (bfloat16 on CUDA, float32 on CPU), ``bfloat16``, ``float16`` or ``float32``.
    qwen_dtype: str = "auto"
    #: qwen: ``auto`` (flash_attention_2 when flash-attn is installed and the device is CUDA, else sdpa),
    #: ``flash_attention_2``, ``sdpa`` or ``eager``. qwen-fast decodes with sdpa whatever this says
    #: (``eager`` applies to a job's prefill only).
    qwen_attention: str = "auto"
    #: qwen: hard cap on codec frames per item (12.5 frames per second of audio; 2048 is about 164 s):
    #: a runaway item, one that never samples its end token, stops here whatever its text length predicts.
    qwen_max_frames: int = 2048
    #: qwen: voice-clone prompts kept per worker (least recently used ones are dropped).
    qwen_clone_cache: int = 64
    #: qwen: weights of the talker's and the code predictor's decoder layers: ``none`` (the dtype
    #: above), ``int8`` (int8 weights per output channel, activations quantized per row at run time)
    #: or ``fp8`` (float8 e4m3 weights per output channel; on a CPU emulated, for fidelity checks
    #: only). Part of the model revision, so quantized audio never answers for full precision.
    qwen_quant: str = "none"
    #: Intra-op threads of each thread that runs torch on a CPU (the batcher, and qwen-fast's codec
    #: thread); 0: the cores this process may use, shared out so the threads never ask for more.
    torch_threads: int = 0
    #: Threads that encode and store finished audio in a worker, off the engine's path (the encoders
    #: release the interpreter lock); 0: the cores this process may use.
    encode_threads: int = 0
    #: standin (the GPU stand-in, ``ttsq.testing.standin``): device microseconds per second of a batch's
    #: longest audio, whatever its rows (the ``a`` of ``a + b * rows``; default from published H100 figures).
    standin_a_us: int = 246_200
    #: standin: device microseconds each row adds per second of the batch's longest audio (the ``b``).
    standin_b_us: int = 5_090
    #: Port of a worker's Prometheus endpoint; a launcher gives its Nth worker this port + N. 0: off.
    metrics_port: int = 9191
    #: Address a worker's Prometheus endpoint listens on: loopback unless a scraper elsewhere needs it
    #: (``0.0.0.0`` in a container whose port only the scrape network reaches).
    metrics_host: str = "127.0.0.1"
    #: How long a stopping worker may take to finish the batches in flight, in seconds, before the
    #: launcher stops it harder (a second SIGTERM does the same at once). Keep it below the grace period
    #: of whatever stops the launcher (systemd, Kubernetes, compose's ``stop_grace_period``).
    drain_timeout_s: int = 120
    # The HTTP gateway (``ttsq serve``): a producer that holds no model.
    #: Address the gateway listens on: loopback unless you put it behind a proxy or a container port.
    gateway_host: str = "127.0.0.1"
    #: TCP port the gateway serves HTTP on (compose publishes it on 127.0.0.1:8080).
    gateway_port: int = 8080
    #: ``keys`` (every API request needs a bearer token from ``ttsq keys add``) or ``none`` (a trusted
    #: network only: anyone who reaches the port can submit).
    gateway_auth: str = "keys"
    #: Admission control: a request for a mode whose queue holds this many waiting jobs or more is
    #: refused with 503 and a ``Retry-After``, and nothing is queued. 0: no limit.
    gateway_max_queue: int = 1000
    #: Largest request body the gateway reads, in bytes (a voice upload may be 32 MiB); a larger one is
    #: refused with 413 before it is read whole.
    gateway_max_body_bytes: int = 1_048_576
    #: How long ``/v1/audio/speech`` and ``/generate`` wait for their audio before answering 504 (the
    #: job goes on; its id is in the ``X-TTSQ-Job-Id`` header).
    gateway_wait_s: int = 300
    # Streams (``stream: true``, every job of the gateway's speech route): docs/streaming.md.
    #: Seconds of audio a job's Redis stream keeps behind its newest piece; older pieces are trimmed as
    #: the worker appends. A reader further behind (or later) continues from the stored file at the
    #: sample it had reached. Redis holds about this times 48 KB per stream (24 kHz).
    stream_window_s: int = 5
    #: How long a job's stream stays readable after its ``end`` or ``error`` entry (seconds); a reader
    #: that comes back later reads the job's stored file.
    stream_grace_s: int = 30
    #: Bytes of encoded audio the gateway holds for one reader whose client is slower than the stream:
    #: past it, the reader stops reading Redis until the client catches up, and then continues from
    #: the stored file if the stream has moved on.
    gateway_stream_buffer_bytes: int = 262_144
    # Long documents (``ttsq submit -f``): split into chunk jobs, stitched into one file.
    #: Longest document accepted (``ttsq submit -f``), in characters after normalization.
    max_document_chars: int = 200_000
    #: Documents: sentences are packed into one chunk job up to this many characters.
    doc_target_chars: int = 200
    #: Documents: the longest chunk; a longer sentence is cut at a clause mark, else at a space. A chunk
    #: is an ordinary job, so this is lowered to TTSQ_MAX_TEXT_CHARS and to what the model's frame cap
    #: reads (TTSQ_QWEN_MAX_FRAMES 2048: 983 characters); on qwen-fast, to what its prompt area holds
    #: beside the instruct (992 bytes of UTF-8, counted at 4 bytes a character: 248 characters with no
    #: instruct).
    doc_max_chars: int = 400
    #: Documents: silence between two chunks at a sentence end, in milliseconds.
    doc_sentence_pause_ms: int = 250
    #: Documents: silence at a paragraph break (a blank line), in milliseconds.
    doc_paragraph_pause_ms: int = 700
    #: Documents: crossfade where an over-long sentence was cut in two, in milliseconds.
    doc_crossfade_ms: int = 40

    def __post_init__(self) -> None:
        _check(self.max_batch >= 1 and self.max_batch <= 256, "max_batch", "must be 1..256")
        _check(0 <= self.release_window <= 100_000, "release_window", "must be 0..100000 (0: no fair shares)")
        _check(1 <= self.bulk_share_percent <= 100, "bulk_share_percent", "must be 1..100")
        _check(0 <= self.tenant_max_in_flight <= 100_000, "tenant_max_in_flight", "must be 0..100000 (0: no cap)")
        self.weights  # noqa: B018  # parsed once here, so a typo stops the process at start
        _check(0 <= self.max_wait_ms <= 10_000, "max_wait_ms", "must be 0..10000")
        _check(0 <= self.encode_threads <= 1024, "encode_threads", "must be 0..1024 (0: the usable cores)")
        _check(0 <= self.standin_a_us <= 100_000_000, "standin_a_us", "must be 0..100000000")
        _check(0 <= self.standin_b_us <= 100_000_000, "standin_b_us", "must be 0..100000000")
        _check(
            1 <= self.url_expiry_s <= MAX_URL_EXPIRY_S,
            "url_expiry_s",
            f"must be 1..{MAX_URL_EXPIRY_S} (S3 presigned URLs live at most 7 days)",
        )
        _check(self.cache_ttl_s >= 0, "cache_ttl_s", "must be >= 0 (0 means no expiry)")
        _check(self.result_ttl_s >= 60, "result_ttl_s", "must be >= 60")
        _check(self.visibility_timeout_s >= 10, "visibility_timeout_s", "must be >= 10")
        _check(self.job_timeout_s >= 1, "job_timeout_s", "must be >= 1")
        # A job still waiting for its batch when the visibility timeout passes is delivered to a
        # second worker while the first one still holds it: a duplicate by construction.
        _check(
            self.job_timeout_s < self.visibility_timeout_s,
            "job_timeout_s",
            f"must be below TTSQ_VISIBILITY_TIMEOUT_S ({self.visibility_timeout_s}), or Redis "
            "redelivers jobs that are still running",
        )
        _check(
            0 <= self.batch_timeout_s <= self.job_timeout_s / 2,
            "batch_timeout_s",
            f"must be 0..half of TTSQ_JOB_TIMEOUT_S ({self.job_timeout_s}): a job waits for the batch "
            "ahead of it and then for its own, and gives up after the job timeout",
        )
        _check(1 <= self.max_attempts <= 100, "max_attempts", "must be 1..100")
        _check(1 <= self.storage_attempts <= 20, "storage_attempts", "must be 1..20")
        _check(0 <= self.storage_backoff_ms <= 60_000, "storage_backoff_ms", "must be 0..60000")
        _check(1 <= self.storage_timeout_s <= 600, "storage_timeout_s", "must be 1..600")
        # The visibility timeout must cover the longest time a healthy worker can hold a message
        # unacknowledged, or Redis hands a job that is still running to a second worker.
        _check(
            self.visibility_timeout_s >= self.min_visibility_timeout_s,
            "visibility_timeout_s",
            f"{self.visibility_timeout_s} s is too short: a job can stay unacknowledged for "
            f"{self.worst_unacked_s:.0f} s (TTSQ_JOB_TIMEOUT_S {self.job_timeout_s} s waiting for its batch, "
            f"then up to {self.storage_budget_s:.0f} s of storage tries); with a 25% margin it must be at "
            f"least {self.min_visibility_timeout_s} s, or lower TTSQ_JOB_TIMEOUT_S / TTSQ_STORAGE_*",
        )
        _check(1 <= self.max_text_chars <= 1_000_000, "max_text_chars", "must be 1..1000000")
        _check(0 <= self.max_instruct_chars <= 100_000, "max_instruct_chars", "must be 0..100000")
        _check(0 <= self.metrics_port <= 65535, "metrics_port", "must be 0..65535 (0 turns metrics off)")
        _check(self.drain_timeout_s >= 1, "drain_timeout_s", "must be >= 1")
        _check(1 <= self.lost_job_grace_s <= 3600, "lost_job_grace_s", "must be 1..3600")
        _check(bool(self.gateway_host), "gateway_host", "must not be empty")
        _check(bool(self.metrics_host), "metrics_host", "must not be empty")
        _check(0 <= self.gateway_port <= 65535, "gateway_port", "must be 0..65535")
        _check(self.gateway_auth in ("keys", "none"), "gateway_auth", "must be keys or none")
        _check(self.cache_scope in ("fleet", "tenant"), "cache_scope", "must be fleet or tenant")
        _check(self.gateway_max_queue >= 0, "gateway_max_queue", "must be >= 0 (0: no limit)")
        _check(1024 <= self.gateway_max_body_bytes <= 64 * 2**20, "gateway_max_body_bytes", "must be 1024..67108864")
        _check(1 <= self.gateway_wait_s <= 3600, "gateway_wait_s", "must be 1..3600")
        _check(1 <= self.stream_window_s <= 600, "stream_window_s", "must be 1..600")
        _check(1 <= self.stream_grace_s <= 3600, "stream_grace_s", "must be 1..3600")
        _check(
            4096 <= self.gateway_stream_buffer_bytes <= 256 * 2**20,
            "gateway_stream_buffer_bytes",
            "must be 4096..268435456",
        )
        _check(1 <= self.max_document_chars <= 10_000_000, "max_document_chars", "must be 1..10000000")
        _check(20 <= self.doc_max_chars <= 100_000, "doc_max_chars", "must be 20..100000")
        _check(
            1 <= self.doc_target_chars <= self.doc_max_chars,
            "doc_target_chars",
            f"must be 1..TTSQ_DOC_MAX_CHARS ({self.doc_max_chars})",
        )
        for name in ("doc_sentence_pause_ms", "doc_paragraph_pause_ms", "doc_crossfade_ms"):
            _check(0 <= getattr(self, name) <= 10_000, name, "must be 0..10000")
        for name in ("broker_url", "result_backend", "cache_url"):
            _check_redis_url(name, getattr(self, name))
            # A Sentinel URL names where to ask, not what: without the master's name it cannot connect.
            _check(
                not is_sentinel_url(getattr(self, name)) or bool(self.redis_master_name),
                "redis_master_name",
                f"must be set: TTSQ_{name.upper()} is a sentinel:// URL, and Sentinel needs the name of the "
                "primary it monitors (sentinel monitor NAME ...)",
            )
        _check(0 <= self.redis_wait_replicas <= 16, "redis_wait_replicas", "must be 0..16")
        _check(1 <= self.redis_wait_timeout_ms <= 60_000, "redis_wait_timeout_ms", "must be 1..60000")
        # A socket timeout that a blocking call may outlast would cut a healthy wait (a WAIT for replicas,
        # a 1 s stream read or broker poll) as if the node had gone silent.
        _check(
            max(2, math.ceil(self.redis_wait_timeout_ms / 1000) + 1) <= self.redis_socket_timeout_s <= 300,
            "redis_socket_timeout_s",
            "must be 2..300 and at least 1 more than TTSQ_REDIS_WAIT_TIMEOUT_MS in seconds",
        )
        _check(1 <= self.redis_connect_timeout_s <= 60, "redis_connect_timeout_s", "must be 1..60")
        _check(1 <= self.redis_health_check_s <= 300, "redis_health_check_s", "must be 1..300")
        for name in ("s3_endpoint_url", "s3_public_endpoint_url"):
            url = getattr(self, name)
            _check(
                not url or (url.startswith(("http://", "https://")) and _port_ok(url)),
                name,
                "must be an http:// or https:// URL",
            )
        _check(bool(self.storage_url), "storage_url", "must not be empty")
        if self.storage_url.startswith("s3://"):
            _check(
                len(self.storage_url[5:].split("/", 1)[0]) >= 3,
                "storage_url",
                "s3:// URL needs a bucket name of at least 3 characters",
            )
        _check(bool(self.engine), "engine", "must not be empty")
        _check(self.aligner in ("whisper", "qwen-aligner"), "aligner", "must be whisper or qwen-aligner")
        _check(
            self.aligner != "qwen-aligner" or bool(self.qwen_aligner_model),
            "qwen_aligner_model",
            "is required for TTSQ_ALIGNER=qwen-aligner: a local Qwen3-ForcedAligner checkpoint folder",
        )
        _check(
            self.qwen_device == "auto"
            or self.qwen_device == "cpu"
            or re.fullmatch(r"cuda(:\d+)?", self.qwen_device) is not None,
            "qwen_device",
            "must be auto, cpu, cuda or cuda:N",
        )
        _check(
            self.qwen_dtype in ("auto", "bfloat16", "float16", "float32"),
            "qwen_dtype",
            "must be auto, bfloat16, float16 or float32",
        )
        _check(
            self.qwen_attention in ("auto", "flash_attention_2", "sdpa", "eager"),
            "qwen_attention",
            "must be auto, flash_attention_2, sdpa or eager",
        )
        _check(16 <= self.qwen_max_frames <= 8192, "qwen_max_frames", "must be 16..8192 (8192 frames is ~11 min)")
        _check(1 <= self.qwen_clone_cache <= 10_000, "qwen_clone_cache", "must be 1..10000")
        _check(self.qwen_quant in ("none", "int8", "fp8"), "qwen_quant", "must be none, int8 or fp8")
        _check(0 <= self.torch_threads <= 1024, "torch_threads", "must be 0 (from the cores) or 1..1024")
        _check(bool(self.queue), "queue", "must not be empty")
        _check(
            self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"},
            "log_level",
            "must be DEBUG, INFO, WARNING or ERROR",
        )
        object.__setattr__(self, "log_level", self.log_level.upper())  # logging wants "INFO", not "info"
        _check(self.log_format in ("text", "json"), "log_format", "must be text or json")

    @property
    def weights(self) -> dict[str, int]:
        """``tenant_weights`` parsed: tenant -> jobs per turn."""
        weights: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in self.tenant_weights.split(","))):
            name, _, number = item.partition("=")
            _check(
                bool(TENANT_PATTERN.fullmatch(name.strip())) and number.strip().isdigit() and 1 <= int(number) <= 1000,
                "tenant_weights",
                f"{item!r}: expected name=weight, a tenant name and a whole number 1..1000",
            )
            weights[name.strip()] = int(number)
        return weights

    @property
    def concurrency(self) -> int:
        """Task threads per worker: twice the batch, so the next batch waits while one runs."""
        return 2 * self.max_batch

    @property
    def inflight_ttl_s(self) -> int:
        """How long a single-flight claim lives: as long as a job can legitimately be unfinished."""
        return self.visibility_timeout_s + self.job_timeout_s

    @property
    def batch_limit_s(self) -> float:
        """The per-batch time limit the worker enforces (``batch_timeout_s``, else half the job
        timeout: a job waits for the batch ahead of it, then for its own)."""
        return float(self.batch_timeout_s or self.job_timeout_s / 2)

    def storage_backoff_s(self, retry: int) -> float:
        """The longest pause before storage try ``retry + 2`` (exponential, capped)."""
        return float(min(MAX_STORAGE_BACKOFF_S, self.storage_backoff_ms / 1000 * 2**retry))

    @property
    def storage_budget_s(self) -> float:
        """Worst time one upload takes with all its tries: each try is an existence check and a
        PUT, each bounded by its connect and read timeouts, plus the longest pause between tries."""
        pauses = sum(self.storage_backoff_s(retry) for retry in range(self.storage_attempts - 1))
        return self.storage_attempts * 2 * 2 * self.storage_timeout_s + pauses

    @property
    def worst_unacked_s(self) -> float:
        """Worst time a healthy worker holds one message: waiting in the worker (prefetch wait plus
        its own batch, capped by the job timeout), then the upload with all its tries."""
        return self.job_timeout_s + self.storage_budget_s

    @property
    def min_visibility_timeout_s(self) -> int:
        """The shortest visibility timeout these settings allow: the worst hold plus 25%."""
        return math.ceil(self.worst_unacked_s * 1.25)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``TTSQ_<FIELD>`` variables; keyword overrides (from flags) win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            variable = ENV_PREFIX + field.name.upper()
            if overrides.get(field.name) is not None:
                values[field.name] = overrides[field.name]
            elif variable in env:
                parse: Callable[[str, str], Any] = _parse_int if field.type == "int" else _parse_str
                values[field.name] = parse(variable, env[variable])
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError("overrides", f"unknown settings {sorted(unknown)}")
        return cls(**values)

    @classmethod
    def sources(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> dict[str, str]:
        """Where ``from_env`` with the same arguments takes each field from: ``override`` (a flag),
        ``environment`` (its ``TTSQ_*`` variable) or ``default``."""
        env = os.environ if environ is None else environ
        return {
            field.name: "override"
            if overrides.get(field.name) is not None
            else "environment"
            if ENV_PREFIX + field.name.upper() in env
            else "default"
            for field in dataclasses.fields(cls)
        }

    def to_env(self) -> dict[str, str]:
        """The ``TTSQ_*`` variables that reproduce these settings in a child process."""
        return {ENV_PREFIX + field.name.upper(): str(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed, validated like the original."""
        return dataclasses.replace(self, **changes)


def _check(ok: bool, field: str, reason: str) -> None:
    if not ok:
        raise ConfigError(ENV_PREFIX + field.upper(), reason)


def _port_ok(url: str) -> bool:
    try:
        urlsplit(url).port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SentinelURL:
    """A ``sentinel://`` URL taken apart: where the Sentinels listen, and which database on the primary."""

    #: Every Sentinel, as (host, port), in the order given.
    sentinels: tuple[tuple[str, int], ...]
    db: int
    #: The data nodes' credentials (the primary's and its replicas'), from the first address.
    username: str | None
    password: str | None

    def for_celery(self) -> str:
        """The URL as kombu and Celery read it: they take the database and the credentials from the first
        address only, so every address carries both."""
        auth = ""
        if self.password is not None:
            auth = f"{quote(self.username or '', safe='')}:{quote(self.password, safe='')}@"
        return ";".join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels)


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` names Redis through Sentinel."""
    return url.startswith("sentinel://")


def parse_sentinel_url(url: str) -> SentinelURL:
    """``sentinel://[[user]:password@]host[:port][;sentinel://host[:port]]...[/db]``; ``ValueError`` names
    what is wrong. The database may be written on any address (Celery's examples put it on the last) but
    must be one number."""
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    username: str | None = None
    password: str | None = None
    for n, chunk in enumerate(url.split(";")):
        if not is_sentinel_url(chunk):
            raise ValueError(f"address {n + 1} ({chunk.split('@')[-1][:60]!r}) must be sentinel://host:port")
        parts = urlsplit(chunk)
        try:
            port = parts.port or 26379
        except ValueError:
            raise ValueError(f"address {n + 1} has a port that is not a number") from None
        if not parts.hostname:
            raise ValueError(f"address {n + 1} has no host")
        path = parts.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"database must be a number, got {path!r}")
            dbs.add(int(path))
        if parts.password is not None and password is None:
            username, password = unquote(parts.username or "") or None, unquote(parts.password)
        sentinels.append((parts.hostname, port))
    if len(dbs) > 1:
        raise ValueError(f"names two databases ({sorted(dbs)}); write it once, on the last address")
    return SentinelURL(sentinels=tuple(sentinels), db=dbs.pop() if dbs else 0, username=username, password=password)


def _check_redis_url(name: str, url: str) -> None:
    if is_sentinel_url(url):
        try:
            parse_sentinel_url(url)
        except ValueError as exc:
            raise ConfigError(ENV_PREFIX + name.upper(), f"sentinel URL: {exc}") from None
        return
    _check(
        url.startswith(("redis://", "rediss://", "unix://")),
        name,
        "must be a redis://, rediss:// (TLS), unix:// or sentinel://host:port;sentinel://host:port/DB URL",
    )
    _check(_port_ok(url), name, "has a port that is not a number")
    path = urlsplit(url).path.strip("/")
    _check(url.startswith("unix://") or path == "" or path.isdigit(), name, f"database must be a number, got {path!r}")


def _parse_int(variable: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(variable, f"expected an integer, got {raw!r}") from None


def _parse_str(variable: str, raw: str) -> str:
    return raw.strip()
