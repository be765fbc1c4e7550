"""A Llama 3.1 tokenizer as a Hugging Face repository of a Llama-3.1-Instruct model holds it, built
offline from what Meta's `llama-models` ships: its tiktoken BPE file and pattern, the 256 special
tokens at Meta's ids, `<|eot_id|>` as the EOS, and a chat template laid out as Meta's own
`ChatFormat` encodes a dialog (a header per message, tool results in the `ipython` role, a JSON
custom-tool call `{"type": "function", "name": ..., "parameters": ...}` closed by `<|eot_id|>`).
The tests check the template's renders token for token against `ChatFormat`'s, so the template
is not taken on trust.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from typing import Any

# What the system message says before the tools' schemas (a JSON object per line).
TOOLS_PREAMBLE = ("You may call a function by answering with one JSON object "
                  '{"type": "function", "name": NAME, "parameters": ARGUMENTS} and nothing else.\n')

TEMPLATE = """{{- bos_token -}}
{%- if tools -%}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + __PREAMBLE__ -}}
{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}{{- f | tojson + '\\n' -}}{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{%- for c in m.tool_calls -%}
{{- '{"type": "function", "name": ' + (c.function.name | tojson) + ', "parameters": ' + (c.function.arguments | tojson) + '}' -}}
{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- else -%}
{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"""


def system_text(schemas: list[dict[str, Any]]) -> str:
    """The system message the template writes for these tools' function schemas."""
    return TOOLS_PREAMBLE + "".join(json.dumps(f, ensure_ascii=False) + "\n" for f in schemas)


def meta_tokenizer() -> Any:
    """Meta's own tokenizer (tiktoken over the file llama-models ships)."""
    from llama_models.llama3.tokenizer import Tokenizer

    return Tokenizer.get_instance()


@functools.lru_cache(maxsize=1)
def llama31_tokenizer() -> Any:
    """The Hugging Face tokenizer, with its chat template; its ids equal Meta's for the same text."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    meta = meta_tokenizer()
    specials = [name for name, _ in sorted(meta.special_tokens.items(), key=lambda kv: kv[1])]
    converted = TikTokenConverter(vocab_file=_model_file(), pattern=meta.pat_str, extra_special_tokens=specials).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = TEMPLATE.replace("__PREAMBLE__", json.dumps(TOOLS_PREAMBLE))  # a Jinja string literal
    return tok


def _model_file() -> str:
    spec = importlib.util.find_spec("llama_models")
    assert spec is not None and spec.origin is not None
    return os.path.join(os.path.dirname(spec.origin), "llama3", "tokenizer.model")
