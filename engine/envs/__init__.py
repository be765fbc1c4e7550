"""What answers a model turn that is not a tool call: environments (simulated users, games, judges).

An environment is one file, registered by name as a tool is, imported through
`engine_tool_modules`. A sample names its environment in its metadata
(`metadata["environment"]`: a name, or `{"name": ..., "args": {...}}`; "none" for a plain
tool task); `engine_environment` (CLI `--environment`) is the default for samples that name none:

    from engine.envs import Environment, Reply, register_environment

    class Guess(Environment):
        name = "guess"

        async def start(self, task):
            return {"secret": int(task.args["secret"]), "tries": 0}

        async def respond(self, episode, conversation):
            episode["tries"] += 1
            if str(episode["secret"]) in conversation.text:
                return Reply(reward=1.0, done=True, reason="guessed", success=True)
            return Reply("No, guess again.", reward=0.0)

    register_environment(Guess())

The engine calls `start` before the sample's first model turn (it may shape the prompt:
`Opening`), `respond` for every model turn that calls no tool, with the conversation so far
(`Conversation`: chat messages as text without special tokens, and the token view), and `end`
once the sample ends, whatever happened. `respond`'s text is appended as the next user turn
(mask 0); its reward is kept with the model turn it answers; `done` ends the episode
(COMPLETED, reason `environment_done`, the environment's `reason` text recorded). Each call is
bounded by `engine_tool_timeout`; a plain (not async) method runs in a worker thread.
An environment's own settings are a class of them under its own prefix, named as its `Settings`
and handed to its `setup` (see `Environment`), with the engine's HTTP client (`HttpClient`: its
pool, reply cap and retry policy) for one that asks a service. Like `engine.tools`, this package imports nothing
else of the engine but the settings' declarations: arrows run one way.
"""

from engine.envs.base import (NONE, Conversation, Environment, EnvironmentFailed, HttpClient, Opening, Reply, Task,
                              check_opening, check_reply, environment_names, get_environment, register_environment,
                              registered_environment, unregister_environment)

from engine.envs import user_simulator  # noqa: E402,F401,I001  (registers the shipped example)

__all__ = ["NONE", "Conversation", "Environment", "EnvironmentFailed", "HttpClient", "Opening", "Reply", "Task", "check_opening",
           "check_reply", "environment_names", "get_environment", "register_environment", "registered_environment",
           "unregister_environment"]
