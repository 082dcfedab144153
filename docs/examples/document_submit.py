"""A long document from Python: one job that fans out into chunk jobs and stitches one audio file."""

import time

from ttsq.client import Client
from ttsq.config import Settings

TEXT = """\
Chapter one. The queue was quiet that morning. Dr. Lee opened the dashboard, read the overnight
figures, and smiled: not one job had been lost.

By noon the first long document arrived. It was split into sentences, packed into chunks, and every
chunk became an ordinary job, cached on its own.

A paragraph break is a longer pause. A cut inside an over-long sentence is a short crossfade instead.
"""

with Client(Settings.from_env()) as client:
    job = client.submit_document(TEXT, language="english", format="mp3")
    print(f"{job.chunks} chunks, job {job.id}")
    shown = None
    while job.id and (status := client.status(job.id))["state"] not in ("SUCCESS", "FAILURE"):
        progress = status.get("progress")  # {"chunks_done", "chunks_total", "audio_s"}, after each chunk
        if progress and progress != shown:
            print(f"progress {progress['chunks_done']}/{progress['chunks_total']} chunks, {progress['audio_s']} s")
            shown = progress
        time.sleep(0.2)
    result = job.wait(timeout=300)  # a DocumentResult: an ordinary result plus the chunk spans
    print(
        f"{result['duration_s']:.2f} s of {result['format']} from {result['document']['chunks']} chunks "
        f"({result['document']['cached_chunks']} from the cache), key {result['key'][:12]}"
    )
    for chunk in result["chunks"]:
        print(
            f"  chars {chunk['start_char']:4}-{chunk['end_char']:4}  "
            f"{chunk['start_s']:6.2f}-{chunk['end_s']:6.2f} s  {chunk['boundary']}"
        )
    print(f"url: {result['url']}")
