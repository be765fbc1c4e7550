"""`--tool-module` that swaps in a code interpreter failing every call (see tests/support/broken_tools.py)."""

from engine import tools
from tests.support.broken_tools import FailingSandbox

tools.register(FailingSandbox(), replace=True)
