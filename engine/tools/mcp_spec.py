"""One entry of `engine_mcp_servers`: how to reach a server, and what it may be told.

An entry is a command line (a stdio server), an http(s) URL (streamable HTTP), or a mapping:

    - name: git                                  # how messages name it (else the name it gives itself)
      command: uvx mcp-server-git --repository .  # or a list of words
      env: [GIT_TOKEN]                           # passed on from the job's environment, by name
    - url: https://mcp.example.com/mcp
      headers: {Authorization: "Bearer ${SEARCH_TOKEN}"}

`env` (stdio) and `headers` (HTTP) take a list of the job's variable names, or a mapping whose
values may name them as `${NAME}`: a secret is never written into the YAML, only its name. The
values are read from the job's environment each time the server is started and kept nowhere
else; a message about the server names it by its name, never by its command line or URL, and
any value read from the environment is replaced by `***` in what the engine writes about it.
"""

from __future__ import annotations

import os
import re
import shlex
import urllib.parse
from collections.abc import Mapping
from typing import Any

import attrs

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEYS = ("name", "command", "url", "env", "headers")
MASK = "***"
MIN_SECRET = 4  # characters: shorter values are not masked


class MissingVariable(ValueError):
    """A variable a server's env or headers name is not set in the job's environment (the message names it)."""


def _pairs(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """`env`/`headers` as (key, template) pairs: a list of variable names means `NAME: ${NAME}`."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        if not all(isinstance(n, str) and _NAME.fullmatch(n) for n in value):
            raise ValueError(f"{what} as a list holds names of the job's environment variables")
        return tuple((n, f"${{{n}}}") for n in value)
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) and k and isinstance(v, (str, int, float)) for k, v in value.items()):
            raise ValueError(f"{what} maps names to text (write a secret as ${{NAME}}, taken from the job's environment)")
        return tuple((k, str(v)) for k, v in value.items())
    raise ValueError(f"{what} is a list of variable names or a mapping, not {type(value).__name__}")


@attrs.frozen
class ServerSpec:
    """One MCP server of `engine_mcp_servers` (hashable: it keys the server's tools and connections).

    `command`: the argv of a stdio server; `url`: a streamable HTTP endpoint (exactly one is set).
    `env`/`headers`: (name, template) pairs, `${NAME}` read from the job's environment when used.
    """

    command: tuple[str, ...] = ()
    url: str | None = None
    name: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, entry: Any) -> ServerSpec:
        """An entry as written in the settings; raises ValueError saying what is wrong (never quoting values)."""
        if isinstance(entry, ServerSpec):
            return entry
        if isinstance(entry, str):
            text = entry.strip()
            return cls.parse({"url": text} if text.startswith(("http://", "https://")) else {"command": text})
        if not isinstance(entry, Mapping):
            raise ValueError(f"an MCP server is a command line, a URL or a mapping, not {type(entry).__name__}")
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ValueError(f"an MCP server entry has no key {', '.join(map(repr, unknown))} (it takes {', '.join(_KEYS)})")
        name = entry.get("name")
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise ValueError("an MCP server's name is text")
        command, url = entry.get("command"), entry.get("url")
        if (command is None) == (url is None):
            raise ValueError("an MCP server entry has either a command (stdio) or a url (streamable HTTP)")
        if url is not None:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError("an MCP server's url is an http:// or https:// URL")
            if entry.get("env"):
                raise ValueError("env is for a stdio server (a command); an HTTP server takes headers")
            return cls(url=url, name=name, headers=_pairs(entry.get("headers"), "headers"))
        if isinstance(command, str):
            argv = tuple(shlex.split(command))
        elif isinstance(command, (list, tuple)) and all(isinstance(w, str) for w in command):
            argv = tuple(command)
        else:
            raise ValueError("an MCP server's command is a command line or a list of words")
        if not argv:
            raise ValueError("an MCP server's command is empty")
        if entry.get("headers"):
            raise ValueError("headers are for an HTTP server (a url); a stdio server takes env")
        return cls(command=argv, name=name, env=_pairs(entry.get("env"), "env"))

    @property
    def where(self) -> str:
        """The server in a message before it has named itself: its `name`, else the program or the
        host (never the arguments, the URL's path, query or credentials)."""
        if self.name:
            return self.name
        if self.url is not None:
            return urllib.parse.urlsplit(self.url).hostname or "an HTTP server"
        return os.path.basename(self.command[0])

    def variables(self) -> list[str]:
        """The job's environment variables this server is given, by name."""
        return [m.group(1) for _, template in (*self.env, *self.headers) for m in _VARIABLE.finditer(template)]

    def missing(self) -> list[str]:
        """The variables it needs that the job's environment does not set."""
        return [n for n in self.variables() if n not in os.environ]

    def resolved_env(self) -> dict[str, str]:
        """The server's extra environment, read from the job's now; raises ValueError naming a missing variable."""
        return self._resolve(self.env, "env")

    def resolved_headers(self) -> dict[str, str]:
        """The HTTP headers, read from the job's environment now; raises ValueError naming a missing variable."""
        return self._resolve(self.headers, "headers")

    def _resolve(self, pairs: tuple[tuple[str, str], ...], what: str) -> dict[str, str]:
        missing = self.missing()
        if missing:
            raise MissingVariable(f"its {what} name {', '.join(missing)}, which the job's environment does not set")
        return {key: _VARIABLE.sub(lambda m: os.environ[m.group(1)], template) for key, template in pairs}

    def secrets(self) -> list[str]:
        """Every value this server is given from the job's environment, and the URL's credentials."""
        found = [os.environ[n] for n in self.variables() if os.environ.get(n)]
        if self.url is not None:
            parts = urllib.parse.urlsplit(self.url)
            found += [p for p in (parts.username, parts.password) if p]
            found += [v for _, v in urllib.parse.parse_qsl(parts.query) if v]
        # The longest first (one may contain another); a value too short to be a secret ("1", "on")
        # would mask every such letter of a message.
        return sorted({s for s in found if len(s) >= MIN_SECRET}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        """`text` with every secret of this server masked (for a message the engine writes about it)."""
        for secret in self.secrets():
            text = text.replace(secret, MASK)
        return text


def parse_servers(value: Any) -> tuple[ServerSpec, ...]:
    """`engine_mcp_servers` as written: a list of entries, or one string of comma-separated ones."""
    items = [p for p in value.split(",") if p.strip()] if isinstance(value, str) else value
    if isinstance(items, Mapping):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise TypeError("not a list of MCP servers")
    return tuple(ServerSpec.parse(item) for item in items)
