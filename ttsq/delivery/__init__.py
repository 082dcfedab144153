"""Delivery: the rules that decide what happens to a job's message between the producer and a worker,
without I/O (the loops in ``ttsq.worker`` read Redis, feed these rules what they saw, and do what they
answer), so that a seeded simulation can drive the same rules through many thousands of interleavings
(``tests/test_delivery_simulation.py``).

``ttsq.delivery.lost``: when an accepted job that no worker received counts as lost and is sent again.
``ttsq.delivery.fanout``: which chunks a document's fan-out sends, resumed after its worker died
(``tests/test_fanout_simulation.py``).
``ttsq.delivery.holders``: when a worker process holding messages counts as dead and recovery gives them
back (``tests/test_delivery_holders_sim.py``).
``ttsq.delivery.lifecycle``: a job's delivery lifecycle as a table of moves, each naming the code that
makes it (a description tied to the code by tests; the records are still kept where they were).
"""
