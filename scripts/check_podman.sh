#!/usr/bin/env bash
# Plays one trivial pod the way the container end-to-end plays the operator's pods
# (`podman kube play`: an init container, then the main container as uid 1000 on a
# read-only root, an emptyDir shared by both, restartPolicy Never), so that a missing
# piece fails here in one line naming it, before any test starts:
#   scripts/check_podman.sh [IMAGE]     (default localhost/kvledger-base:bookworm,
#                                        made by scripts/container_base.sh)
set -uo pipefail
IMAGE=${1:-localhost/kvledger-base:bookworm}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "$0")" && pwd)/containers.conf}
POD=kvledger-podman-check

fail() { echo "error: podman check: $*" >&2; exit 1; }

# The binaries `kube play` execs; podman looks for its helpers in /usr/libexec/podman too.
for binary in podman conmon runc catatonit; do
    command -v "$binary" >/dev/null || [ -x "/usr/libexec/podman/$binary" ] \
        || fail "$binary is not installed (scripts/install_podman.sh installs it)"
done
podman image exists "$IMAGE" || fail "no image $IMAGE (scripts/container_base.sh makes it)"

workdir=$(mktemp -d)
cleanup() {
    podman pod rm -f "$POD" >/dev/null 2>&1
    podman volume rm -f "$POD-work" >/dev/null 2>&1
    rm -rf "$workdir"
}
trap cleanup EXIT
podman pod rm -f "$POD" >/dev/null 2>&1

cat >"$workdir/pod.yaml" <<YAML
apiVersion: v1
kind: Pod
metadata:
  name: $POD
spec:
  restartPolicy: Never
  initContainers:
    - name: init
      image: $IMAGE
      command: [/usr/bin/python3, -c, "open('/work/ok', 'w').write('init ran')"]
      volumeMounts: [{name: $POD-work, mountPath: /work}]
  containers:
    - name: main
      image: $IMAGE
      command: [/usr/bin/python3, -c, "import os; print(open('/work/ok').read(), 'uid', os.getuid())"]
      securityContext: {runAsUser: 1000, runAsGroup: 1000, readOnlyRootFilesystem: true}
      volumeMounts: [{name: $POD-work, mountPath: /work}]
  volumes:
    - name: $POD-work
      emptyDir: {}
YAML

# podman's own message, made into one line that names the piece when it is a known one.
explain() {
    local message=$1
    case "$message" in
        *catatonit*) fail "podman cannot build its pause image: catatonit is missing" \
                          "(apt-get install catatonit): $message" ;;
        *RLIMIT*|*setrlimit*) fail "the runtime refused the ulimits; CONTAINERS_CONF" \
                                   "($CONTAINERS_CONF) must set default_ulimits: $message" ;;
        *cgroup*) fail "cgroups: CONTAINERS_CONF ($CONTAINERS_CONF) must set" \
                       "cgroup_manager = \"cgroupfs\" and runtime = \"runc\": $message" ;;
        *"OCI runtime"*"not found"*) fail "the OCI runtime is missing (apt-get install runc): $message" ;;
        *"working conmon"*) fail "conmon is missing (apt-get install conmon): $message" ;;
        *netavark*|*CNI*|*"cni plugin"*|*'plugin type='*) fail "the container network stack" \
            "failed (containernetworking-plugins): $message" ;;
        *) fail "podman kube play of a trivial pod failed: $message" ;;
    esac
}

if ! played=$(podman kube play --quiet "$workdir/pod.yaml" 2>&1); then
    explain "$(printf '%s\n' "$played" | grep -v '^\s*$' | tail -n 1)"
fi
status=$(podman wait "$POD-main" 2>&1) || explain "$(printf '%s\n' "$status" | tail -n 1)"
logs=$(podman logs "$POD-main" 2>&1)
[ "$status" = 0 ] || fail "the trivial pod's container exited $status: $(printf '%s\n' "$logs" | tail -n 1)"
[ "$logs" = "init ran uid 1000" ] || fail "the trivial pod printed '$logs', not 'init ran uid 1000'"
echo "podman check: a pod with an init container ran as uid 1000 on a read-only root ($IMAGE)"
