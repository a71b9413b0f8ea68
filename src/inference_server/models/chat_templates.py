"""Chat templates the engine supplies itself, for models whose files carry none.

The embedded Gemma 3 270M is a base model converted to GGUF without a chat template; so that chat requests
work out of the box, it gets Gemma's documented turn format (``<start_of_turn>role ... <end_of_turn>``, the
assistant role called ``model``, system text folded into the first user turn, as Gemma's own template does).
``CHAT_TEMPLATE`` (a file) overrides any model's template.

``turn_markers`` names the strings that open or close a turn in the template actually served: a chat reply
must end at them (a base model, having no notion of turns, would otherwise write the user's next turn and
go on to the end of the context).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs

from inference_server.config import SettingsError
from inference_server.records.sampling_params import SamplingParams

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- if tools -%}"
    "{%- set ns.system = 'You can call these functions:\\n<tools>\\n' -%}"
    "{%- for tool in tools -%}{%- set ns.system = ns.system + (tool | tojson) + '\\n' -%}{%- endfor -%}"
    "{%- set ns.system = ns.system + '</tools>\\n\\nTo call one, reply with <tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>\\n\\n' -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<tool_response>\\n' + message['content'] | trim + '\\n</tool_response>' }}"
    "{%- else -%}{{ message['content'] | trim }}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if message['content'] | trim or not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string -%}{{ call['function']['arguments'] }}"
    "{%- else -%}{{ call['function']['arguments'] | tojson }}{%- endif -%}"
    "{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
"""Gemma's turns, plus tools in the Hermes style the ``hermes`` parser reads (Gemma 3 has no tool format of its
own): the tool list goes before the first user text like a system prompt, an assistant's calls are written
``<tool_call>{"name", "arguments"}</tool_call>``, a ``tool`` result is a user turn inside ``<tool_response>``."""


def read_chat_template(path: str) -> str:
    """The template text of the ``CHAT_TEMPLATE`` file; a missing file stops start-up with a clear error."""
    file = Path(path)
    if not file.is_file():
        raise SettingsError(f"CHAT_TEMPLATE={path!r} is invalid: no such file")
    return file.read_text()


TURN_MARKERS = ("<end_of_turn>", "<start_of_turn>", "<|im_end|>", "<|im_start|>", "<|eot_id|>",
                "<|start_header_id|>", "<|end|>", "<|user|>", "<|assistant|>", "<|turn>", "<turn|>")
"""Turn delimiters of the common chat formats (Gemma 2/3, Gemma 4, ChatML/Qwen, Llama 3, Phi)."""


def turn_markers(template: str | None, token_to_id: Callable[[str], int | None],
                 special_tokens: Iterable[str | None] = ()) -> tuple[str, ...]:
    """The turn markers of ``template``: each known marker (``TURN_MARKERS``) and each of the tokenizer's
    ``special_tokens`` (its end-of-sequence text, say) that the template writes literally and the vocabulary
    holds as one token. A template written for another vocabulary names no marker it cannot produce;
    ``None`` (no template) has none."""
    if not template:
        return ()
    candidates = dict.fromkeys([*TURN_MARKERS, *(t for t in special_tokens if t)])
    return tuple(marker for marker in candidates if marker in template and token_to_id(marker) is not None)

# -- the stops every chat request gets --------------------------------------------------------------------
# A chat reply ends where the template would start or end a turn (``<end_of_turn>``, ``<start_of_turn>`` for
# Gemma). Each marker is added twice: as a stop string (a model that spells the marker out in pieces) and,
# when it is one token, as a stop token id (the detokenizer hides special tokens, so a string match alone
# would miss a marker emitted as its own token). Neither shows in the reply unless
# ``include_stop_str_in_output``. Ids that already end generation (the model's EOS ids) are not repeated, so
# such a finish still reports ``stop_reason: null``. A request with ``ignore_eos`` (benchmarks fixing the
# output length) gets none. The HTTP chat route and the offline ``LLM.chat`` (and ``generate(chat=True)``) apply
# them.


@attrs.frozen
class ChatStops:
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, tokenizer: Any | None, eos_token_ids: frozenset[int]) -> ChatStops:
        """The markers of ``tokenizer``'s chat template (none without a tokenizer or a template)."""
        token_to_id = getattr(tokenizer, "token_to_id", None)
        if tokenizer is None or token_to_id is None:
            return cls()
        markers = turn_markers(getattr(tokenizer, "chat_template", None), token_to_id,
                               [getattr(tokenizer, "eos_token", None)])
        ids = [token_to_id(m) for m in markers]
        return cls(markers, tuple(i for i in dict.fromkeys(ids) if i is not None and i not in eos_token_ids))

    def apply(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the markers added to its own stops (unless it ignores EOS)."""
        if params.ignore_eos or not (self.strings or self.token_ids):
            return params
        stop = params.stop + tuple(s for s in self.strings if s not in params.stop)
        stop_ids = params.stop_token_ids + tuple(i for i in self.token_ids if i not in params.stop_token_ids)
        return attrs.evolve(params, stop=stop, stop_token_ids=stop_ids)
