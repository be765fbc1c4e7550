"""A Mistral v3 tokenizer as a Hugging Face repository of a Mistral-Instruct-v0.3 model holds it,
built offline from what `mistral-common` ships: its SentencePiece model (`legacy=False`, the
control tokens as special tokens) and a chat template laid out as mistral-common renders
(`[AVAILABLE_TOOLS]` before the last user turn, `[TOOL_CALLS]` and a JSON array with ids, the EOS,
`[TOOL_RESULTS]` naming the call id). The tests check the template's renders token for token
against mistral-common's own, so the template is not taken on trust.
"""

from __future__ import annotations

import functools
import os
from typing import Any

CONTROLS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]

# Whitespace matters: every text after a control token starts with the space SentencePiece's
# dummy prefix writes. A result's call id must be 9 alphanumerics, as in Mistral's own template.
TEMPLATE = """{%- set last_user = namespace(i=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set last_user.i = loop.index0 -%}{%- endif -%}{%- endfor -%}
{{- bos_token -}}
{%- for m in messages -%}
{%- if m.role == 'user' -%}
{%- if tools and loop.index0 == last_user.i -%}
{{- '[AVAILABLE_TOOLS] [' -}}
{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}
{{- '{"type": "function", "function": {"name": ' + (f.name | tojson) + ', "description": ' + (f.description | tojson)
    + ', "parameters": ' + (f.parameters | tojson) + '}}' -}}{{- ', ' if not loop.last else '' -}}
{%- endfor -%}
{{- '][/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{{- '[INST] ' + m.content + '[/INST]' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{{- '[TOOL_CALLS] [' -}}
{%- for c in m.tool_calls -%}
{%- if c.function.arguments is string -%}{{- raise_exception('arguments must be an object here') -}}{%- endif -%}
{{- '{"name": ' + (c.function.name | tojson) + ', "arguments": ' + (c.function.arguments | tojson) + ', "id": '
    + (c.id | tojson) + '}' -}}{{- ', ' if not loop.last else '' -}}
{%- endfor -%}
{{- ']' + eos_token -}}
{%- elif m.role == 'assistant' -%}
{{- ' ' + m.content + eos_token -}}
{%- elif m.role == 'tool' -%}
{%- if m.tool_call_id is not defined or m.tool_call_id | length != 9 -%}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') -}}
{%- endif -%}
{{- '[TOOL_RESULTS] {"content": ' + (m.content | tojson) + ', "call_id": ' + (m.tool_call_id | tojson) + '}[/TOOL_RESULTS]' -}}
{%- endif -%}
{%- endfor -%}"""


def _sentencepiece_model() -> str:
    import importlib.util

    spec = importlib.util.find_spec("mistral_common")
    assert spec is not None and spec.origin is not None
    return os.path.join(os.path.dirname(spec.origin), "data", "mistral_instruct_tokenizer_240323.model.v3")


@functools.lru_cache(maxsize=1)
def mistral_v3_tokenizer() -> Any:
    """The tokenizer, with its chat template; ids equal mistral-common's for the same text."""
    from transformers import SentencePieceBackend

    class MistralV3(SentencePieceBackend):
        def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str:
            # SentencePieceBackend writes byte-fallback pieces as "<0xF0>": each run of ordinary
            # pieces is decoded by SentencePiece itself (no dummy prefix here: a leading "▁" is a space).
            ids = [int(i) for i in (token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids)]
            out, run = [], []
            for i in [*ids, None]:
                if i is None or i in self.all_special_ids:
                    if run:
                        out.append(self.sp_model.decode(run))
                        run = []
                    if i is not None and not skip_special_tokens:
                        out.append(self.convert_ids_to_tokens(i))
                else:
                    run.append(i)
            return "".join(out)

    tok = MistralV3(vocab_file=_sentencepiece_model(), bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                    extra_special_tokens=CONTROLS, legacy=False, add_bos_token=False, add_eos_token=False)
    tok.chat_template = TEMPLATE
    return tok
