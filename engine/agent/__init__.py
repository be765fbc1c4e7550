"""The agent front door: agents that speak OpenAI or Anthropic, served as turns of the machine.

Membership: code that serves a harness (Claude Code, Codex, the OpenAI Agents SDK, LangGraph,
SWE-agent, ...) through the protocols it speaks, and the sessions behind them. The protocol
modules turn requests into protocol-neutral `engine.agent.calls.ModelCall`s and answers back
into replies; the sessions turn each call into a turn of one sample's machine. Imported only
when an agent is configured: `import engine.slime` does not load this package's server.
"""
