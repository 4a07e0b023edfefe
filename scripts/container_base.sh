#!/usr/bin/env bash
# Make a Debian 12 base image with Python 3.11 from Debian's packages, for machines that
# reach package mirrors but no image registry (the project's container tests use it):
#   scripts/container_base.sh [IMAGE]      (default localhost/kvledger-base:bookworm)
# The image is kept in podman's storage, and the root filesystem tarball under
# $KVLEDGER_CACHE (default ~/.cache/kvledger), so a later run on the same machine takes
# seconds. Needs root (mmdebstrap --mode=root), podman and mmdebstrap.
set -euo pipefail
IMAGE=${1:-localhost/kvledger-base:bookworm}
CACHE=${KVLEDGER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvledger}
TARBALL=$CACHE/base-bookworm.tar
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "$0")" && pwd)/containers.conf}

if podman image exists "$IMAGE"; then
    echo "$IMAGE: present"
    exit 0
fi
if [ ! -s "$TARBALL" ]; then
    command -v mmdebstrap >/dev/null || { echo "error: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
    mkdir -p "$CACHE"
    # Without documentation, man pages and locales; the mirror is the host's apt default.
    mmdebstrap --variant=minbase --mode=root --quiet \
        --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        --format=tar bookworm "$TARBALL.part"
    mv "$TARBALL.part" "$TARBALL"
fi
podman import --quiet "$TARBALL" "$IMAGE" >/dev/null
echo "$IMAGE: imported from $TARBALL"
