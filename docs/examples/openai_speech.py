"""OpenAI's Python package, pointed at the ttsq gateway: the code you have runs unchanged."""

import os

import openai

# OPENAI_BASE_URL and OPENAI_API_KEY: the lines `ttsq serve --embedded` prints, or your gateway's
# http://HOST:8080/v1 and a key from `ttsq keys add NAME`.
client = openai.OpenAI()

with client.audio.speech.with_streaming_response.create(
    model="gpt-4o-mini-tts",  # OpenAI's model names mean the fleet's default mode
    voice="alloy",  # not a speaker of the fleet: ignored, and said so
    input="Hello from ttsq, through OpenAI's own client.",
    instructions="A calm, warm voice.",
    response_format="wav",
    extra_body={"language": "english", "seed": 7},  # ttsq's own request fields ride along
) as response:
    response.stream_to_file("hello.wav")
    print(f"ignored: {response.headers.get('x-ttsq-ignored')}, job key {response.headers['x-ttsq-key'][:12]}")
print(f"wrote hello.wav: {os.path.getsize('hello.wav')} bytes")

try:
    client.audio.speech.create(model="tts-1", voice="alloy", input="Faster, please.", speed=1.5)
except openai.BadRequestError as exc:  # ttsq cannot time-stretch: it says so, naming the field
    print(f"refused: {exc.param}: {exc.message}")
