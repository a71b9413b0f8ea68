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

from inference_server.config import SettingsError

GEMMA_TURNS = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + message['content'] + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if role == 'user' -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


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
