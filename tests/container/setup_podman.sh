#!/usr/bin/env bash
# Arrange podman for the container test (tests/container/test_compose.py) on a Debian CI machine.
#
# Idempotent; needs root. What it does, and why (see ../shared/ENV.md "Containers and clusters"):
#   1. apt-installs podman, runc, netavark, aardvark-dns, iptables, debootstrap and docker-compose
#      (the latter only validates compose files offline: no Docker engine runs here) when missing.
#   2. writes /etc/containers/containers.conf: runc as the runtime (crun fails on these machines'
#      hybrid cgroups), the cgroupfs manager (no systemd) and ulimits the container may not raise.
#   3. makes the base image docker.io/library/debian:bookworm-slim locally with debootstrap, since
#      no container registry can be reached: the Dockerfile's default BASE_IMAGE then resolves.
# Any failure stops it with a non-zero exit: CI must run the container test, not skip it.
#
# Usage: sudo tests/container/setup_podman.sh      (env BASE_TAG overrides the image name)
set -euo pipefail

BASE_TAG="${BASE_TAG:-docker.io/library/debian:bookworm-slim}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
CONF=/etc/containers/containers.conf

log() { echo "setup_podman: $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (apt-get, /etc/containers, podman storage)"

# 1. Packages. netavark + aardvark-dns: container networks whose DNS resolves service names and
# container hostnames; iptables: published ports.
packages=(podman runc netavark aardvark-dns iptables debootstrap docker-compose)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q || die "apt-get update failed"
    apt-get install -y -q --no-install-recommends "${missing[@]}" \
        || die "apt-get install ${missing[*]} failed"
else
    log "${packages[*]}: already installed"
fi

# 2. containers.conf (rewritten only when it differs, so reruns change nothing).
want=$(cat <<'EOF'
# Written by pdserve tests/container/setup_podman.sh.
[containers]
# The machine does not permit raising ulimits beyond these.
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
# crun fails on this machine's hybrid cgroups; there is no systemd to manage cgroups.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
)
mkdir -p "$(dirname "$CONF")"
if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$want" ]; then
    log "$CONF: up to date"
else
    [ -f "$CONF" ] && cp "$CONF" "$CONF.bak.$(date +%s)" && log "kept the old $CONF as a .bak"
    printf '%s\n' "$want" >"$CONF"
    log "$CONF: written"
fi

# 3. The base image.
if podman image exists "$BASE_TAG"; then
    log "$BASE_TAG: present"
else
    rootfs=$(mktemp -d /var/tmp/pdserve-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrapping $SUITE (minbase) from $MIRROR into $rootfs (about 30 s)"
    debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 \
        || { tail -n 30 "$rootfs.log" >&2; die "debootstrap failed (full log: $rootfs.log)"; }
    rm -f "$rootfs.log"
    # What the official slim image also drops: apt's package lists and caches.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | podman import --quiet \
        --change 'CMD ["bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - "$BASE_TAG" >/dev/null || die "podman import failed"
    podman image exists "$BASE_TAG" || die "$BASE_TAG missing after import"
    log "$BASE_TAG: imported ($(podman image inspect --format '{{.Size}}' "$BASE_TAG") bytes)"
fi

# A smoke run proves runtime, cgroups and ulimits work before any test depends on them.
podman run --rm --network=none "$BASE_TAG" true || die "podman run $BASE_TAG true failed"
log "ok"
