"""A web backend without ttsq: send ``ttsq.synthesize`` by name with plain Celery, read the result JSON.

It needs only ``pip install 'celery[redis]'``. The Redis URLs are your deployment's (here from the same
``TTSQ_*`` variables the workers read); ``ttsq`` is the queue of voice_design jobs, the default mode.
"""

import os

from celery import Celery

app = Celery(
    broker=os.environ.get("TTSQ_BROKER_URL", "redis://localhost:6379/0"),
    backend=os.environ.get("TTSQ_RESULT_BACKEND", "redis://localhost:6379/1"),
)
result = app.send_task(
    "ttsq.synthesize",
    queue="ttsq",
    kwargs={
        "text": "안녕하세요. 티티에스큐 음성 합성입니다.",
        "language": "korean",
        "instruct": "밝은 목소리",
        "format": "mp3",
    },
)
job = result.get(timeout=60)  # the result JSON as a dict: no audio, no input text
print(f"url: {job['url']}")  # presigned; valid for url_expires_s seconds
print(
    f"{job['duration_s']:.2f} s of {job['format']} at {job['sample_rate']} Hz by {job['engine']} "
    f"(batch of {job['batch_size']}), key {job['key'][:12]}, ignored: {job['ignored']}"
)

# A bad request fails the task with InvalidRequest; its arguments are [field, reason].
bad = app.send_task("ttsq.synthesize", queue="ttsq", kwargs={"text": "Hello", "language": "klingon"})
try:
    bad.get(timeout=60)
except Exception as exc:  # without ttsq installed, Celery rebuilds the error under the same name
    field, reason = exc.args
    print(f"refused: {type(exc).__name__} on {field!r}: {reason}")
