#!/usr/bin/env bash
# The sandbox's attack suite in the three modes an engine runs in (root with namespaces, root
# without CAP_SYS_ADMIN, an ordinary user), one column each; exit 1 when an attack got through
# that docs/sandbox-modes.md does not list as the mode's gap. Run as root (CI does).
#   tools/attack_modes.sh [--json] [--report PATH] [--mode root|no-sys-admin|user ...]
# Runs the engine of this checkout with $PYTHON (default: python).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" -m engine.sandbox.attacks.modes "$@"
