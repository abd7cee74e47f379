#!/usr/bin/env bash
# Install redis-server for the KV remote tier's tests (tests/integration/test_kv_remote_tier.py
# and the colocated stack test that restarts on a shared store) on a Debian CI machine.
#
# Idempotent; needs root. The tests start their own server on a free loopback port with no
# persistence (tests/support/servers.py, RedisServer), so the package's service is not started
# (invoke-rc.d is told not to start services while the package installs). Any failure stops it
# with a non-zero exit: CI must run those tests, not skip them (they fail, not skip, without
# redis-server when CI is set).
#
# Usage: sudo tests/setup_redis.sh
set -euo pipefail

log() { echo "setup_redis: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (apt-get)"

if command -v redis-server >/dev/null 2>&1; then
    log "redis-server: already installed ($(redis-server --version | head -n 1))"
    exit 0
fi

POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$POLICY"
    chmod 755 "$POLICY"
    trap 'rm -f "$POLICY"' EXIT
fi

log "installing redis-server"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends redis-server \
    || { apt-get update -q || die "apt-get update failed"; \
         apt-get install -y -q --no-install-recommends redis-server; } \
    || die "apt-get install redis-server failed"
command -v redis-server >/dev/null 2>&1 || die "redis-server missing after the install"
log "ok ($(redis-server --version | head -n 1))"
