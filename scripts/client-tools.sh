#!/usr/bin/env bash
# The OpenAI Python client (and pydantic) that tests/structured.rs drives kvmesh with, in a
# venv under target/ (made once, reused). Prints the venv's python on success.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVMESH_CLIENT_TOOLS:-target/client-tools}"
OPENAI_VERSION=3.57.0
PYDANTIC_VERSION=2.14.4
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! "$venv/bin/python" -c 'import openai, pydantic' 2>/dev/null; then
    echo "scripts/client-tools.sh: installing openai $OPENAI_VERSION into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        "openai==$OPENAI_VERSION" "pydantic==$PYDANTIC_VERSION" >&2
fi
echo "$venv/bin/python"
