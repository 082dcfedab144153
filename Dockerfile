# The ttsq image: command line, worker and client in one. CPU engine (espeak) by default; the Qwen
# engine's image adds the `qwen` extra on a CUDA base (see the Qwen engine issue).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ttsq ./ttsq
COPY cli ./cli
COPY workers ./workers
RUN pip install --no-cache-dir . && useradd --system --uid 10001 ttsq
USER ttsq
CMD ["ttsq", "worker"]
