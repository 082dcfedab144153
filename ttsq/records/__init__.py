"""Everything ttsq keeps in Redis, and the one owner of its connections in a process.

Each module is one kind of record (the cache index and single-flight claims, the accepted jobs, the
attempts and parked jobs, fleet statistics, queue depths, dead letters); ``connection`` opens the
clients they all share, one per Redis database, and ``scripts`` registers the Lua scripts (``lua/``)
once. Nothing here imports the worker, the batcher or the gateway.
"""
