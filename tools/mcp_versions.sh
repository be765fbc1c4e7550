#!/usr/bin/env bash
# The MCP tests against each release of the mcp SDK named (default: the first of each minor the
# pyproject's pin allows, as far as this list knows), each installed on its own (--no-deps) into a
# scratch folder laid over the environment of $PYTHON (default: python), whose SDK dependencies
# serve them all. The engine's MCP client uses the SDK's public names only; this is what says a
# release still gives them.
#   tools/mcp_versions.sh [VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.0.0 2.1.0 2.2.0 2.3.0)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for version in "${versions[@]}"; do
    target="$scratch/mcp-$version"
    "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
        "mcp==$version" "mcp-types==$version"
    echo "== mcp $version"
    PYTHONPATH="$target:$PWD" "$python" -m pytest -q -p no:cacheprovider tests/tools/test_mcp_sdk.py \
        tests/tools/test_mcp_spec.py tests/tools/test_mcp_servers.py tests/tools/test_mcp_lifetimes.py \
        tests/tools/test_mcp_secrets.py
done
