"""Chat templates for files that carry none, by architecture (llama.cpp keeps such a list too): Gemma 3's
and Gemma 4's turn formats.

Gemma 3's GGUF conversions often lack `tokenizer.chat_template`, yet the model was trained on one
turn format: `<start_of_turn>user ... <end_of_turn>` and `<start_of_turn>model ...`, with a system
message folded into the first user turn (Gemma has no system role).
"""

from __future__ import annotations

GEMMA = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set first_prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

# Gemma 4's turns, as its own template (llama.cpp's models/templates/google-gemma-4-31B-it.jinja) renders
# a conversation of text without tools or thinking: a system turn of its own, and an empty thought
# channel opening the model's turn.
GEMMA4 = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}"
    "{{ '<|turn>system\n' + messages[0]['content'] | trim + '<turn|>\n' }}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' + message['content'] | trim + '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\n<|channel>thought\n<channel|>' }}{%- endif -%}"
)

BUILTIN = {"gemma3": GEMMA, "gemma4": GEMMA4}


def builtin_template(architecture: str) -> str | None:
    """The usual chat template of `architecture`, or None where kvgen knows none."""
    return BUILTIN.get(architecture)
