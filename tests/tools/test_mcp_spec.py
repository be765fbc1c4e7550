"""`engine_mcp_servers` entries: the forms they take, what is refused, and what a message may show."""

from __future__ import annotations

import pytest

from engine.settings import EngineConfig, SettingsError
from engine.settings.declare import read_key
from engine.tools.mcp_servers import McpSettings
from engine.tools.mcp_spec import MissingVariable, ServerSpec, parse_servers
from tests.support.helpers import make_args


def test_a_command_line_a_url_and_a_mapping_are_entries() -> None:
    specs = parse_servers(["uvx mcp-server-time --local-timezone 'Europe/Paris'", "https://mcp.example.com/mcp",
                           {"name": "git", "command": ["uvx", "mcp-server-git"], "env": ["GIT_TOKEN"]},
                           {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer ${TOKEN}", "X-Team": "rl"}}])
    assert specs[0] == ServerSpec(command=("uvx", "mcp-server-time", "--local-timezone", "Europe/Paris"))
    assert specs[1] == ServerSpec(url="https://mcp.example.com/mcp")
    assert specs[2] == ServerSpec(command=("uvx", "mcp-server-git"), name="git", env=(("GIT_TOKEN", "${GIT_TOKEN}"),))
    assert specs[3].headers == (("Authorization", "Bearer ${TOKEN}"), ("X-Team", "rl"))
    assert parse_servers("python a.py, python b.py") == (ServerSpec(command=("python", "a.py")), ServerSpec(command=("python", "b.py")))


def test_the_settings_read_entries_from_slimes_args_and_keep_the_config_hashable() -> None:
    entry = {"name": "git", "command": "uvx mcp-server-git", "env": {"GITHUB_TOKEN": "${MY_TOKEN}"}}
    cfg = EngineConfig.from_args(make_args(engine_mcp_servers=[entry], engine_mcp_failures="observation",
                                           engine_mcp_list_timeout=5))
    mcp = cfg.plugin(McpSettings)
    assert mcp.servers == (ServerSpec(command=("uvx", "mcp-server-git"), name="git", env=(("GITHUB_TOKEN", "${MY_TOKEN}"),)),)
    assert (mcp.failures, mcp.list_timeout) == ("observation", 5.0)
    assert McpSettings(servers=["python s.py"]).servers == (ServerSpec(command=("python", "s.py")),)  # built directly, read alike
    assert hash(cfg) == hash(EngineConfig.from_args(make_args(engine_mcp_servers=[dict(entry)], engine_mcp_failures="observation",
                                                              engine_mcp_list_timeout=5)))
    with pytest.raises(SettingsError, match="engine_mcp_failures must be one of unavailable, observation"):
        read_key("engine_mcp_failures", "ignore")


@pytest.mark.parametrize("entry, problem", [
    ({"command": "x", "url": "http://h/mcp"}, "either a command"),
    ({"name": "x"}, "either a command"),
    ({"url": "ftp://h/mcp"}, "http:// or https:// URL"),
    ({"command": ""}, "command is empty"),
    ({"command": "x", "headers": {"A": "b"}}, "headers are for an HTTP server"),
    ({"url": "http://h/mcp", "env": ["K"]}, "env is for a stdio server"),
    ({"command": "x", "env": ["not a name"]}, "names of the job's environment variables"),
    ({"command": "x", "env": {"K": ["a"]}}, "maps names to text"),
    ({"command": "x", "secret": "s3cr3t"}, "no key 'secret'"),
    (42, "not int"),
    ({"command": "x", "env": {"K": "s3cr3t"}, "header": 1}, "no key 'header'"),
])
def test_a_bad_entry_is_one_sentence_that_quotes_no_value(entry: object, problem: str) -> None:
    with pytest.raises(SettingsError, match=f"^engine_mcp_servers: .*{problem}") as raised:
        read_key("engine_mcp_servers", [entry])
    assert "s3cr3t" not in str(raised.value)


def test_values_come_from_the_jobs_environment_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = ServerSpec.parse({"command": "srv", "env": {"API_KEY": "${FSM_K}", "MODE": "fast", "BOTH": "${FSM_K}:${FSM_U}"}})
    monkeypatch.setenv("FSM_K", "key-value-1")
    monkeypatch.delenv("FSM_U", raising=False)
    assert spec.missing() == ["FSM_U"]
    with pytest.raises(MissingVariable, match="its env name FSM_U, which the job's environment does not set"):
        spec.resolved_env()
    monkeypatch.setenv("FSM_U", "user-value-2")
    assert spec.resolved_env() == {"API_KEY": "key-value-1", "MODE": "fast", "BOTH": "key-value-1:user-value-2"}
    assert spec.redact("the server said key-value-1 and user-value-2, fast") == "the server said *** and ***, fast"


def test_a_message_names_a_server_without_its_arguments_or_url_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ServerSpec.parse("/opt/bin/srv --token abc123").where == "srv"
    url = ServerSpec.parse("https://user:pa55word@mcp.example.com:8443/v1/mcp?api_key=qwerty12")
    assert url.where == "mcp.example.com"
    assert url.redact("refused https://user:pa55word@mcp.example.com:8443/v1/mcp?api_key=qwerty12") == \
        "refused https://***:***@mcp.example.com:8443/v1/mcp?api_key=***"
    assert ServerSpec.parse({"name": "search", "url": "https://h/mcp"}).where == "search"
    monkeypatch.setenv("FSM_SHORT", "1")
    assert ServerSpec.parse({"command": "srv", "env": ["FSM_SHORT"]}).redact("exited with status 1") == "exited with status 1"


def test_the_docs_entries_read_as_settings() -> None:
    import re
    from pathlib import Path

    import yaml

    page = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text(encoding="utf-8")
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", page, re.DOTALL) if "headers:" in b)
    servers = EngineConfig.from_args(make_args(**yaml.safe_load(block))).plugin(McpSettings).servers
    assert [s.name for s in servers] == ["git", "search", "docs"]
    assert servers[0].env == (("GIT_TOKEN", "${GIT_TOKEN}"),)
    assert servers[1].command == ("npx", "-y", "some-search-server")
    assert servers[2].variables() == ["DOCS_TOKEN"]
