"""The batcher: one thread owns the engine and runs the jobs task threads hand it, in batches.

``batcher`` is the loop, ``jobs`` the bookkeeping both schedulers share, ``batches`` the grouped
scheduler (a batch per group, waiting for company only while more jobs are coming) and ``slots`` the
continuous one (qwen-fast's rows admitted between frames). Plain threads and futures: no Celery.
"""
