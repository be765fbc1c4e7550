"""`--tool-module` that swaps in a code interpreter whose sandbox cannot start (see tests/support/broken_tools.py)."""

from engine import tools
from tests.support.broken_tools import DeadSandbox

tools.register(DeadSandbox(), replace=True)
