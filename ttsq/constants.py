"""Names that producers, workers and operators share: Redis keys, the task, the queue.

Everything that lands in Redis is namespaced ``ttsq:``. Changing any of these is a wire change.
"""

from __future__ import annotations

import re

#: ttsq's own version (``ttsq.__version__``, ``ttsq --version``, the gateway's OpenAPI document).
VERSION = "0.1.0"

#: The public task. Web backends call ``send_task(TASK_NAME, kwargs=...)`` without importing ttsq.
TASK_NAME = "ttsq.synthesize"

#: A long document: split, one ``ttsq.synthesize`` job per chunk, stitched by ``ttsq.stitch`` (``ttsq.document``).
DOCUMENT_TASK_NAME = "ttsq.document"
STITCH_TASK_NAME = "ttsq.stitch"
#: Version of the document-key recipe and of the stitching (joins, pauses, crossfade shape).
DOCUMENT_SCHEMA_VERSION = 1
#: Custom Celery state of a document while its chunks run; its meta is ``ttsq.document.Progress``.
PROGRESS_STATE = "PROGRESS"
#: The state of a job whose worker died holding it, given back to its queue (``ttsq.worker.recovery``).
REQUEUED_STATE = "REQUEUED"

#: The queue every worker consumes and every producer sends to.
DEFAULT_QUEUE = "ttsq"

#: Version of the content-key recipe. Bump it when what goes into the key changes.
KEY_SCHEMA_VERSION = 1

#: Version of what happens to the engine's samples before encoding (gain, resampling, ...).
POSTPROCESS_VERSION = 1

# Redis keys (the cache index database).
CACHE_PREFIX = "ttsq:cache:"  # + content key -> JSON index entry; TTL = settings.cache_ttl_s
INFLIGHT_PREFIX = "ttsq:inflight:"  # + content key -> task id of the job producing it; SET NX EX
FLEET_PREFIX = "ttsq:fleet:"  # + queue -> hash: mode -> JSON identity of the model serving it, re-announced
FLEET_NODES_PREFIX = "ttsq:fleet-nodes:"  # + queue -> hash: node -> JSON identity it announced; removed as it stops
DOCUMENT_PREFIX = "ttsq:document:"  # + document key -> JSON of the stitched file and its chunk spans
PROGRESS_PREFIX = "ttsq:progress:"  # + document task id -> hash: chunk index -> audio seconds; TTL = result TTL
PLAN_PREFIX = "ttsq:plan:"  # + document task id -> hash: plan (JSON), chunks (count); TTL = result TTL
STREAM_PREFIX = "ttsq:stream:"  # + task id -> stream of a streaming job's audio pieces (``ttsq.records.streams``)
FANOUT_PREFIX = "ttsq:fanout:"  # + document task id -> "sending" (lease) or "sent"; TTL = result TTL
MINUTE_PREFIX = "ttsq:minute:"  # + Unix minute -> hash of that minute's job counters; TTL below
WORKER_PREFIX = "ttsq:worker:"  # + node name -> JSON heartbeat of a live worker; TTL below
RESTARTS_KEY = "ttsq:restarts"  # hash: node name -> times a launcher restarted it
WAITS_PREFIX = "ttsq:waits:"  # + Unix minute -> hash: "<bucket>|<tenant>" -> jobs that waited so long; TTL below

#: A job's stream expires this long after an entry other than its last (seconds): longer than any pause
#: of a live writer, short enough that the stream of a worker that died goes by itself. After its
#: ``end`` or ``error`` it goes ``TTSQ_STREAM_GRACE_S`` later (``ttsq.records.streams``).
STREAM_LIVE_TTL_S = 120

#: How long per-minute counters are kept (seconds): ``ttsq stats`` looks back at most this far.
MINUTE_STATS_TTL_S = 2 * 3600
#: A worker rewrites its heartbeat this often (seconds); it expires after the TTL if the worker dies.
HEARTBEAT_INTERVAL_S = 5.0
HEARTBEAT_TTL_S = 20
PARKED_KEY = "ttsq:parked"  # hash: task id -> JSON of a job failed after too many attempts

#: Exit status of a worker whose engine ran past the per-batch limit (EX_SOFTWARE): any supervisor
#: (systemd, compose ``restart:``, ``ttsq worker --devices``) restarts it; its jobs are redelivered.
EXIT_ENGINE_STUCK = 70
#: How long a worker keeps retrying its own Redis calls while Redis restarts (seconds).
WORKER_REDIS_PATIENCE_S = 30.0

#: Message header with the producer's wall-clock send time (seconds), for the queue-wait figure.
SENT_AT_HEADER = "ttsq_sent_at"

#: Message header with the content key the producer claimed for this job (single flight), so the
#: worker can release the claim even when it cannot compute the key itself (the job was invalid).
CLAIM_HEADER = "ttsq_claim"

#: Message header of a chunk job: ``{"id": <document task id>, "index": i, "total": n}``, so the
#: worker that finishes the chunk can report the document's progress.
DOCUMENT_HEADER = "ttsq_document"

#: How long a producer trusts the models the workers announced before reading them again (seconds).
IDENTITY_TTL_S = 10.0
#: Workers re-announce their model with every heartbeat (HEARTBEAT_INTERVAL_S); an announcement older than
#: this is taken for a worker that is gone, so a retired mode stops being "served" within two minutes.
IDENTITY_MAX_AGE_S = 120.0
#: A worker's own announcement at most this old (seconds) is a worker running now: it re-announces every
#: HEARTBEAT_INTERVAL_S, and a stopping worker withdraws it. A new worker's claim on its queue (one queue, one
#: model) and the gateway's readiness go by it; producers keep IDENTITY_MAX_AGE_S, to ride out a restart.
FLEET_LIVE_S = 20.0
#: How often a worker's readiness probe looks at its object store again (seconds); probes in between get
#: the last answer.
STORAGE_CHECK_INTERVAL_S = 5.0

# The defaults of ttsq's Redis socket limits (seconds; TTSQ_REDIS_SOCKET_TIMEOUT_S and the two beside it):
# a silent node is given up within seconds, so a client moves to the new primary a failover names.
REDIS_CONNECT_TIMEOUT_S = 2
REDIS_SOCKET_TIMEOUT_S = 3
REDIS_HEALTH_CHECK_INTERVAL_S = 1
#: The most connections one of a process's sync Redis clients opens (redis-py's own default is 100): a
#: ``Client`` shared by threads holds one per call under way, and the 101st thread's call failed with
#: "Too many connections" (benchmarks/fleet.py, 128 waiting threads).
REDIS_MAX_CONNECTIONS = 1024

# kombu's Redis transport (the broker database): read by ``ttsq.delivery.broker``, written by ``ttsq.records.holders``.
#: kombu's hash of delivered, unacknowledged messages (delivery tag -> message), all queues.
UNACKED_KEY = "unacked"
#: kombu's index of the same messages by delivery time: its visibility timeout is measured from there.
UNACKED_INDEX_KEY = "unacked_index"

# The accepted-job ledger (the cache database): every job a producer accepted, until it finishes, so a
# message lost between the broker and a worker is sent again (``ttsq.records.accepted``).
# + task id -> hash: task, queue, kwargs, headers, seq, accepted_at, seen_at, attempts (engine calls with the job in
# them that never returned: ``ttsq.records.attempts``), state (accepted, deferred, running,
# done, failed, cancelled: the job's state as the ledger's scripts move it, its cancel and its settled outcome
# included), owner (the tenant), follows (the job a follower's audio comes from); once the job finishes only owner,
# follows and an outcome stay: for the results' TTL (a settled outcome alone: for the in-flight TTL).
ACCEPTED_PREFIX = "ttsq:accepted:"
UNSEEN_PREFIX = "ttsq:unseen:"  # + queue -> zset: task id by seq, accepted and not yet received by a worker
RECEIVED_KEY = "ttsq:received"  # zset: task id by the time a worker received it, until it finishes
SEQ_PREFIX = "ttsq:seq:"  # + queue -> the queue's acceptance counter (the order producers accepted jobs in)
WATERMARK_PREFIX = "ttsq:watermark:"  # + queue -> hash: seq, at: the highest seq a worker received, and when
SWEEPER_LOCK_PREFIX = "ttsq:sweeper:"  # + base queue -> the worker running the sweep; PX lock
#: Counter a producer bumps right before ``WAIT``: Redis counts a ``WAIT`` from its own connection's last write,
#: and this write comes after the job's record on the one replication stream (TTSQ_REDIS_WAIT_REPLICAS).
REPLICATED_KEY = "ttsq:replicated"
#: How long an accepted job's record lives at most (seconds): a backstop; records go when jobs finish.
ACCEPTED_TTL_S = 7 * 24 * 3600

#: Message header with the job's place in its queue's acceptance order (``ttsq.records.accepted``).
SEQ_HEADER = "ttsq_seq"
#: A document chunk's place in its document's chord, kept in its accepted record's headers and never sent
#: as a header: ``{"group": <chord group id>, "index": i, "body": <the stitch's signature>}``. Whoever sends
#: the chunk (the fan-out, the releaser, the sweeper) sends it as that chord's part (``ttsq.sending``).
CHORD_HEADER = "ttsq_chord"

# Fair shares (the cache database; docs/scheduling.md): while a queue's list is full, an accepted job
# waits in its tenant's place, and workers release the tenants' jobs into the list in round robin.
DEFERRED_PREFIX = "ttsq:deferred:"  # + queue + ":" + tenant -> list: task ids in the order accepted
TENANTS_PREFIX = "ttsq:tenants:"  # + queue -> list: tenants with deferred jobs, the next to release first
TENANT_SET_PREFIX = "ttsq:tenant-set:"  # + queue -> set: the same tenants, to add each once
TURNS_PREFIX = "ttsq:turns:"  # + queue -> hash: tenant -> jobs released in its current turn (its weight)
# The per-tenant cap on jobs in flight (TTSQ_TENANT_MAX_IN_FLIGHT; docs/scheduling.md): a job counts from
# its send (or release) until its record is finished; a member whose record no longer counts it is aged out.
TENANT_IN_FLIGHT_PREFIX = "ttsq:tenant-in-flight:"  # + base queue + ":" + tenant -> zset: task id by Redis time sent
TENANTS_IN_FLIGHT_PREFIX = "ttsq:tenants-in-flight:"  # + base queue -> set: tenants with such a zset, for the ager
IN_FLIGHT_AGED_PREFIX = "ttsq:in-flight-aged:"  # + base queue -> 1 for a while after a worker aged the counts; EX
#: A tenant's name: what ``ttsq stats`` and metrics show, so an identifier, never a secret.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,63}")
#: The tenant of a job that names none: one more tenant, sharing the fleet with the others.
DEFAULT_TENANT = "default"
#: A tenant's document chunks wait in a place of their own in the release ring (the tenant's name and this
#: suffix, which no tenant name has): they take turns like a tenant and are held to no in-flight cap, since
#: their document already counts against it and waits for them (docs/scheduling.md).
CHUNKS_SUFFIX = "/chunks"

#: Which worker process holds which unacknowledged message (the broker database; ``ttsq.records.holders``).
HOLDERS_KEY = "ttsq:holders"  # set: incarnations (node#pid) that held messages
HOLDER_PREFIX = "ttsq:holder:"  # + incarnation -> its heartbeat (JSON), or "dead" once its launcher saw it exit
HELD_PREFIX = "ttsq:held:"  # + incarnation -> set: delivery tags it holds, beside kombu's ``unacked`` hash
#: How often a worker process renews its heartbeat, and how long one lasts without renewal (seconds).
HOLDER_BEAT_S = 2.0
HOLDER_TTL_S = 10.0
#: How long a worker process remembers an ack it made, to make it again on a new connection once its
#: broker connection drops (``ttsq.delivery.acks``): a failover loses the writes of the old primary's
#: last moments that its replica had not received, and an entry of kombu's ``unacked`` hash an ack lost
#: so deleted would wait for the visibility timeout and run its job again. At least the data nodes'
#: ``min-replicas-max-lag``, which bounds what a failover loses (docs/high-availability.md: 2 s advised,
#: Redis's default 10 s); what it costs is the acks a process makes in that time, a few strings each.
ACKS_REMEMBERED_S = 10.0

#: Dead letters (the broker database): messages a worker refused to run, raw (``ttsq.delivery.envelope``).
DEAD_LETTERS_KEY = "ttsq:dead"

# The HTTP gateway's API keys and limits (the cache database; ``ttsq.gateway.apikeys``).
APIKEY_PREFIX = "ttsq:apikey:"  # + SHA-256 of the token -> hash: id, name, created_at, revoked_at, limits
APIKEY_IDS_KEY = "ttsq:apikeys"  # hash: key id -> SHA-256 of its token
RATE_PREFIX = "ttsq:rate:"  # + key id + ":" + Unix minute -> requests in that minute; TTL 120 s
QUOTA_PREFIX = "ttsq:quota:"  # + key id + ":" + Unix day -> audio milliseconds served that day; TTL 2 days

# Named voices (the cache database; ``ttsq.records.named_voices``): a voice kept under a name.
NAMED_VOICES_KEY = "ttsq:named-voices"  # hash: voice name -> JSON record (mode, instruct, language, seed, ...)
