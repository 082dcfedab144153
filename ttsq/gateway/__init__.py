"""``ttsq serve``: the HTTP gateway, a producer like the command line, holding no model.

``app`` assembles the FastAPI application, ``routes`` declares the endpoints, ``bodies`` the request
models they take (checked by ttsq's own validation), ``openai`` translates OpenAI's speech API into
ttsq's request, ``speech`` answers it as the worker makes the audio (``streams`` reads the jobs' Redis
streams on one connection, ``encoders`` turns their pieces into the response format), ``state`` holds
the gateway's clients, ``waiter`` waits on results without a thread per request, ``apikeys`` keeps keys
and limits in Redis, ``errors`` renders every failure in OpenAI's error shape.
"""
