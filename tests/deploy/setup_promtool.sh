#!/usr/bin/env bash
# Install promtool for tests/deploy/test_observability.py (it checks the Prometheus alert and
# recording rules of deploy/observability and the compose Prometheus config) on a Debian CI machine.
#
# Idempotent; needs root. Debian ships promtool in the package `prometheus` (which also holds the
# server: its maintainer scripts would start one, so invoke-rc.d is told not to start services
# while the package installs). Any failure stops it with a non-zero exit: CI must run that test,
# not skip it (the test fails, not skips, without promtool when CI is set).
#
# Usage: sudo tests/deploy/setup_promtool.sh
set -euo pipefail

log() { echo "setup_promtool: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (apt-get)"

if command -v promtool >/dev/null 2>&1; then
    log "promtool: already installed ($(promtool --version 2>&1 | head -n 1))"
    exit 0
fi

# No service starts during the install (a policy-rc.d that denies all, only if none is there).
POLICY=/usr/sbin/policy-rc.d
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$POLICY"
    chmod 755 "$POLICY"
    trap 'rm -f "$POLICY"' EXIT
fi

log "installing prometheus (for promtool)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q || die "apt-get update failed"
apt-get install -y -q --no-install-recommends prometheus || die "apt-get install prometheus failed"
command -v promtool >/dev/null 2>&1 || die "promtool missing after installing prometheus"
log "ok ($(promtool --version 2>&1 | head -n 1))"
