"""kombu's connection and Sentinel transport as every ttsq app opens them (producers and workers): the
transport an app names is kept across a failover, and a message published on a dropped connection goes
to the primary the Sentinels name now. The worker's consuming transport is ``ttsq.delivery.transport``.
"""

from __future__ import annotations

from celery.app.amqp import AMQP as CeleryAMQP
from kombu.connection import Connection as KombuConnection
from kombu.transport import redis as kombu_redis
from kombu.utils.url import parse_url

from ttsq.records.connection import SentinelConnection


class Connection(KombuConnection):
    """kombu's connection, keeping the transport it was built with when it fails over to another URL.

    A Sentinel broker URL lists every Sentinel (``sentinel://a;sentinel://b;...``), and kombu moves to
    the next one after a connection error with ``switch``, which takes the transport from the URL's
    scheme: ttsq's (the worker's gated one, a producer's Sentinel-following one) became kombu's stock
    Sentinel transport after the first failover. The worker then read ``NOREPLICAS`` from a primary
    just promoted as an unrecoverable error and ended, and consumed past its envelope gate.
    """

    def switch(self, conn_str: str) -> None:
        super().switch(conn_str)  # type: ignore[no-untyped-call]
        given = self._initial_params.get("transport")  # what the app named, never a URL's scheme
        if given is not None and "://" in conn_str:
            params = {**self._initial_params, **parse_url(conn_str)}
            params["transport"] = given
            self._init_params(**params)  # type: ignore[no-untyped-call]


class AMQP(CeleryAMQP):  # type: ignore[misc]
    """Celery's messaging on ttsq's ``Connection``: every connection an app opens (a worker's consumer,
    every producer) keeps ttsq's transport across a failover."""

    Connection = Connection
    BrokerConnection = Connection


class SentinelChannel(kombu_redis.SentinelChannel):
    """kombu's Sentinel channel on ttsq's ``SentinelConnection``: a message published on a dropped
    connection goes to the primary the Sentinels name now, not to the old one's address."""

    connection_class = SentinelConnection


class SentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with ``SentinelChannel``: what producers send through behind Sentinel."""

    Channel = SentinelChannel
