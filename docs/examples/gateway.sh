#!/usr/bin/env bash
# The gateway with curl: OpenAI's speech endpoint, then a job through the jobs API.
#   OPENAI_BASE_URL and OPENAI_API_KEY: the lines `ttsq serve --embedded` prints (or your gateway's
#   http://HOST:8080/v1 and a key from `ttsq keys add NAME`).
set -euo pipefail
GATEWAY=${OPENAI_BASE_URL%/v1}
AUTH="Authorization: Bearer $OPENAI_API_KEY"

# OpenAI's speech API: the audio itself, Korean with a voice described in words.
curl -sSf "$GATEWAY/v1/audio/speech" -H "$AUTH" -H "Content-Type: application/json" -o hello.mp3 \
  -d '{"model": "tts-1", "voice": "alloy", "input": "안녕하세요. 티티에스큐입니다.",
       "instructions": "차분한 30대 여성 목소리", "language": "korean", "response_format": "mp3"}'
echo "speech: $(wc -c < hello.mp3) bytes of mp3"

# The jobs API: submit (202 and the job's id), poll until it is done, fetch its audio.
job=$(curl -sSf "$GATEWAY/v1/jobs" -H "$AUTH" -H "Content-Type: application/json" \
  -d '{"text": "A job through the jobs API.", "format": "wav"}')
id=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<< "$job")
until curl -sSf "$GATEWAY/v1/jobs/$id" -H "$AUTH" | grep -q '"state": *"SUCCESS"'; do sleep 0.5; done
curl -sSf "$GATEWAY/v1/jobs/$id/audio" -H "$AUTH" -o job.wav
echo "job $id: $(wc -c < job.wav) bytes of wav"

# An id the gateway never accepted is a 404, in OpenAI's error shape.
curl -sS "$GATEWAY/v1/jobs/no-such-job" -H "$AUTH"; echo
