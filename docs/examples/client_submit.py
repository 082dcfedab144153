"""Submit from Python with ttsq installed: validation at the edge, the cache short-circuit, single flight."""

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.errors import InvalidRequest

settings = Settings.from_env()  # the TTSQ_* variables of your deployment
with Client(settings) as client:
    job = client.submit(
        "Hello from ttsq. This sentence went through a real queue.", language="english", format="mp3", seed=7
    )
    result = job.wait(timeout=60)  # a JobResult (a dict), its URL presigned just now
    print(
        f"{result['duration_s']:.2f} s of {result['format']} by {result['worker']}, "
        f"batch of {result['batch_size']}, synthesis {result['timings']['synthesis_s']:.3f} s"
    )
    print(f"url: {result['url']}")

    # The same request again: answered from the cache index at once, no queue trip, no worker.
    again = client.submit(
        "Hello from ttsq. This sentence went through a real queue.", language="english", format="mp3", seed=7
    )
    print(f"again: cached={again.cached}, same key={again.wait()['key'] == result['key']}")

    # A bad request raises InvalidRequest naming the field; nothing is queued.
    try:
        client.submit("Hello", language="klingon")
    except InvalidRequest as exc:
        print(f"refused: {exc}")
