#!/usr/bin/env bash
# What the container end-to-end needs, from Debian's packages (about a minute):
#   podman + runc   `podman build` (the image) and `podman kube play` (the rendered pods)
#   catatonit       the binary podman builds its local pause image from for `kube play`;
#                   only a Recommends of podman, so --no-install-recommends leaves it out
#   mmdebstrap      a Debian base image made locally (no image registry is reachable)
# Installs what is missing and nothing else; scripts/check_podman.sh then plays one trivial
# pod so that a piece still missing fails in one line naming it. Needs root and apt-get
# when something is missing.
set -euo pipefail
PACKAGES=(podman runc catatonit mmdebstrap ca-certificates)

installed() { dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null | grep -qx installed; }

missing=()
if command -v dpkg-query >/dev/null; then
    for package in "${PACKAGES[@]}"; do
        installed "$package" || missing+=("$package")
    done
else
    command -v podman >/dev/null || missing+=(podman)
fi
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: the container end-to-end needs ${missing[*]}; install them" \
         "(Debian: apt-get install --no-install-recommends ${PACKAGES[*]})" \
         "or set KVLEDGER_SKIP_CONTAINER_E2E=1 to skip it" >&2
    exit 1
fi
echo "installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
