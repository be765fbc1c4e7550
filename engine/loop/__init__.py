"""The async loop: what happens between two triggers of the machine.

Membership: code that awaits (the per-sample driver, the runtime samples share, tool calls
and their limits, the abort signal). It feeds the machine, never decides
an edge itself.
"""
