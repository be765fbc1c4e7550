#!/usr/bin/env bash
# Regenerate what is drawn or written from the code: the machine's diagrams (diagrams/ and the
# README's drawing, from the machine's definition) and docs/settings.md (from the settings).
# Run after changing a state, an edge, a guard or a setting, then commit the files it wrote.
#   tools/regenerate.sh           write them
#   tools/regenerate.sh --check   exit 1 if any is stale (what tests/trace/test_diagrams.py and
#                                 tests/local/test_settings.py check), writing nothing
# Runs the engine of this checkout with $PYTHON (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
case "${1:-}" in
    "") "$python" -m engine diagram
        "$python" -m engine settings --out docs/settings.md ;;
    --check) "$python" -m engine diagram --check
             "$python" -m engine settings --out docs/settings.md --check ;;
    *) echo "usage: tools/regenerate.sh [--check]" >&2; exit 2 ;;
esac
