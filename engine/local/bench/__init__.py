"""`python -m engine bench`: engine overheads, each measured next to its floor in one run.

Modules, one per concern: `common` (sizes, rows, statistics), `server` (the canned
loopback server, a subprocess), `rollout` (figures 1 and 6), `fsm` (2), `sandbox` (3, 4),
`memory` (5), `agent` and `agent_harness` (8), `long` (9), `report` (table, JSON), `main` (the command). Importing this package
imports none of them, so the server subprocess starts without the engine's imports.
"""

from __future__ import annotations

import argparse


def main_bench(ns: argparse.Namespace) -> int:
    """Run every figure, print the table (or JSON); 0 unless something crashed."""
    from engine.local.bench.main import main_bench as run

    return run(ns)


__all__ = ["main_bench"]
