# The ttsq image: command line, worker, Flower and client in one. CPU engine (espeak) by default; build the
# GPU worker image with `--build-arg EXTRAS=qwen` (PyPI's torch 2.11.0 wheels bring their own CUDA 13
# libraries, so a slim base works on any host with the NVIDIA container toolkit and an R580+ driver).
# docker-compose.yml builds EXTRAS=flower (CPU worker, `ttsq flower`) and EXTRAS=qwen,flower (GPU workers).
FROM python:3.11-slim
ARG EXTRAS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
# sox: qwen-tts needs it; the other extras do not.
RUN case ",$EXTRAS," in *,qwen,*) apt-get update -qq && apt-get install -y -qq --no-install-recommends sox \
      && rm -rf /var/lib/apt/lists/*;; esac
COPY pyproject.toml README.md ./
COPY ttsq ./ttsq
COPY cli ./cli
COPY workers ./workers
RUN pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}" && useradd --system --uid 10001 ttsq
USER ttsq
CMD ["ttsq", "worker"]
