"""Everything ttsq keeps in Redis, and the one owner of its connections in a process.

Each module is one kind of record (the cache index and single-flight claims, engine identities, the
accepted jobs with one record each, the attempts and parked jobs, fleet statistics, queue depths,
dead letters, leases, named voices); ``owner`` holds one client per Redis database and hands them out,
``connection`` says how a client is opened and how its failures read, and ``scripts`` loads the Lua
scripts (``lua/``). Nothing here imports the worker, the batcher or the gateway.
"""
