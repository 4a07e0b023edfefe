#!/usr/bin/env bash
# The container engine the end-to-end test needs: podman + buildah with runc, and
# mmdebstrap to make a base image without a registry (Debian's packages; about a minute).
# Does nothing when podman is already there; needs root and apt-get otherwise.
set -euo pipefail
if command -v podman >/dev/null && command -v mmdebstrap >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: the container end-to-end needs podman, buildah, runc and mmdebstrap; install them" \
         "(Debian: apt-get install podman buildah runc mmdebstrap uidmap slirp4netns" \
         "fuse-overlayfs) or set KVLEDGER_SKIP_CONTAINER_E2E=1 to skip it" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends podman buildah runc mmdebstrap uidmap \
    slirp4netns fuse-overlayfs ca-certificates >/dev/null
