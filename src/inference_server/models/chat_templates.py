"""Chat templates the engine supplies itself, for models whose files carry none.

The embedded Gemma 3 270M is a base model converted to GGUF without a chat template; so that chat requests
work out of the box, it gets Gemma's documented turn format (``<start_of_turn>role ... <end_of_turn>``, the
assistant role called ``model``, system text folded into the first user turn, as Gemma's own template does).
``CHAT_TEMPLATE`` (a file) overrides any model's template.
"""

from __future__ import annotations

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
