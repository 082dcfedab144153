"""Delivery: how a job's message travels between the producer and a worker, and the one room of the
house that touches kombu's transport or its key layout.

The rules decide what happens to a message, without I/O (the loops in ``ttsq.worker`` read Redis, feed
these rules what they saw, and do what they answer), so that seeded simulations drive the same rules
through many thousands of interleavings:

``ttsq.delivery.lost``: when an accepted job that no worker received counts as lost and is sent again
(``tests/test_delivery_simulation.py``).
``ttsq.delivery.fanout``: which chunks a document's fan-out sends, resumed after its worker died
(``tests/test_fanout_simulation.py``).
``ttsq.delivery.holders``: when a worker process holding messages counts as dead and recovery gives them
back (``tests/test_delivery_holders_sim.py``).
``ttsq.delivery.acks``: which of a worker's acks go on its broker connection and which on a new one once
it is lost, and what a failover's lost writes ask of them (``tests/test_delivery_holders_sim.py``).
``ttsq.delivery.lifecycle``: a job's delivery lifecycle as a table of moves, each naming the code that
makes it, and what the job's one record in the ledger says in each state (the record's scripts run under
``tests/test_ledger_simulation.py``).

``ttsq.delivery.cycle``: the order a worker's ``BRPOP`` asks its queues in (lanes, docs/scheduling.md).
``ttsq.delivery.envelope``: what a broker message may look like before a worker takes it in (the checks
the worker's envelope gate, ``ttsq.worker.gate``, runs).

kombu's side, each fenced against the version it was written for (``tests/test_fence.py``):
``ttsq.delivery.broker``: kombu's key layout (its lists, priority lists and ``unacked`` hash), read
straight from Redis.
``ttsq.delivery.connection``: the connection and Sentinel transport every app opens (the app's layer).
``ttsq.delivery.transport``: the channel, the bookkeeping of held messages and the consumer a worker
consumes through (the worker's layer).
"""
