"""Named chat templates (``data.chat_template``), in the layouts of the model families they are
named for, written for transformers' ``apply_chat_template``: each wraps the assistant's reply and
its end-of-turn marker in ``{% generation %}``, so the assistant mask is exact. Special tokens are
the tokenizer's (``bos_token``, ``eos_token``); a system message that the family has no turn for
opens the next user turn."""
from __future__ import annotations

import os
from pathlib import Path

from lctrain.config.fields import suggest
from lctrain.errors import ConfigError

_REPLY = "{% generation %}{{- m.content | trim ~ END }}{% endgeneration %}"
_SYSTEM = "{%- set ns = namespace(system='') %}"  # system text waiting for the next user turn
_HOLD = "{%- if m.role == 'system' %}{%- set ns.system = ns.system ~ m.content ~ '\\n\\n' %}"
_CHATML_TURNS = (
    "{%- for m in messages %}{%- if m.role == 'tool' and TOOL %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' ~ m.role ~ '\\n' }}{%- if m.role == 'assistant' %}"
    "{% generation %}{{- m.content ~ '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- m.content ~ '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
TEMPLATES = {
    "chatml": _CHATML_TURNS.replace(" and TOOL", " and false"),
    "qwen2": "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are Qwen, created "
             "by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
             + _CHATML_TURNS.replace(" and TOOL", ""),
    "llama3": "{{- bos_token }}{%- for m in messages %}{{- '<|start_header_id|>' ~ ('ipython' if "
              "m.role == 'tool' else m.role) ~ '<|end_header_id|>\\n\\n' }}{%- if m.role == "
              "'assistant' %}" + _REPLY.replace("END", "'<|eot_id|>'") + "{%- else %}{{- m.content "
              "| trim ~ '<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- "
              "'<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    "mistral": "{{- bos_token }}" + _SYSTEM + "{%- for m in messages %}" + _HOLD + "{%- elif "
               "m.role == 'user' %}{{- '[INST] ' ~ ns.system ~ m.content ~ ' [/INST]' }}{%- set "
               "ns.system = '' %}{%- elif m.role == 'assistant' %}{% generation %}{{- m.content ~ "
               "eos_token }}{% endgeneration %}{%- else %}{{- '[TOOL_RESULTS] ' ~ m.content ~ "
               "' [/TOOL_RESULTS]' }}{%- endif %}{%- endfor %}",
    "gemma": "{{- bos_token }}" + _SYSTEM + "{%- for m in messages %}" + _HOLD + "{%- else %}{{- "
             "'<start_of_turn>' ~ ('model' if m.role == 'assistant' else 'user') ~ '\\n' }}{%- if "
             "m.role == 'assistant' %}" + _REPLY.replace("END", "'<end_of_turn>'") + "{{- '\\n' }}"
             "{%- else %}{{- ns.system ~ m.content | trim ~ '<end_of_turn>\\n' }}{%- set "
             "ns.system = '' %}{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
             "{{- '<start_of_turn>model\\n' }}{%- endif %}"}
"""Template name -> Jinja source."""


def resolve_template(value: str) -> str:
    """The Jinja source of ``data.chat_template``: a name of :data:`TEMPLATES` or a file's text
    (ConfigError: neither)."""
    if value in TEMPLATES:
        return TEMPLATES[value]
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        return Path(path).read_text(encoding="utf-8")
    raise ConfigError(f"data.chat_template {value!r} is neither a template name "
                      f"({', '.join(TEMPLATES)}) nor an existing .jinja file"
                      f"{suggest(value, TEMPLATES)}", key="data.chat_template")
