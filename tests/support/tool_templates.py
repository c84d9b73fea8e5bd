"""Chat templates that can express tools, written for these tests in the three families' syntaxes, and a copy
of a GGUF with its `tokenizer.chat_template` replaced (the `gguf` package)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Hermes / Qwen style: tools listed in the system turn, calls as <tool_call> JSON blocks, results as a user turn
HERMES = r"""
{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if sys %}{{ sys + '\n\n' }}{% endif -%}
{{- 'You may call functions to answer. Their signatures, one JSON object a line, are in <tools></tools>:\n' -}}
{{- '<tools>\n' -}}
{%- for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor -%}
{{- '</tools>\nTo call one, answer with its name and arguments inside <tool_call></tool_call> tags:\n' -}}
{{- '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call><|im_end|>\n' -}}
{%- elif sys -%}
{{- '<|im_start|>system\n' + sys + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{{- '<|im_start|>assistant\n' -}}
{%- if m.content %}{{ m.content + '\n' }}{% endif -%}
{%- for call in m.tool_calls -%}
{%- if not loop.first %}{{ '\n' }}{% endif -%}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' -}}
{{- call.function.arguments | tojson -}}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""

# Llama 3.x style: the functions go into the first user turn, a call is the whole reply, results are ipython turns
LLAMA3 = r"""
{{- bos_token -}}
{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools %}{{ 'Environment: ipython\n' }}{% endif -%}
{{- sys + '<|eot_id|>' -}}
{%- set ns = namespace(first=true) -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- elif m.role == 'user' and tools and ns.first -%}
{%- set ns.first = false -%}
{{- '<|start_header_id|>user<|end_header_id|>\n\nIf one of these functions helps with the message below, answer ' -}}
{{- 'with a call: {"name": function name, "parameters": object of argument values}, and nothing else.\n\n' -}}
{%- for tool in tools %}{{ tool | tojson(indent=2) }}{{ '\n\n' }}{% endfor -%}
{{- m.content + '<|eot_id|>' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{%- set call = m.tool_calls[0].function -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' -}}
{{- (call.arguments | tojson) + '}<|eot_id|>' -}}
{%- elif m.role == 'tool' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + m.content + '<|eot_id|>' -}}
{%- else -%}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif -%}
"""

# Mistral v3 style: [AVAILABLE_TOOLS] before the last user turn, [TOOL_CALLS] JSON arrays, 9-character call ids
MISTRAL = r"""
{{- bos_token -}}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor -%}
{%- for m in messages -%}
{%- if m.role == 'user' or m.role == 'system' -%}
{%- if tools and loop.index0 == ns.last_user -%}
{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}
{%- endif -%}
{{- '[INST]' + m.content + '[/INST]' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{{- '[TOOL_CALLS][' -}}
{%- for c in m.tool_calls -%}
{%- if c.id is not defined or c.id | length != 9 -%}
{{- raise_exception('a tool call id must be 9 letters and digits') -}}
{%- endif -%}
{{- '{"name": "' + c.function.name + '", "arguments": ' + (c.function.arguments | tojson) -}}
{{- ', "id": "' + c.id + '"}' -}}
{%- if not loop.last %}{{ ', ' }}{% endif -%}
{%- endfor -%}
{{- ']' + eos_token -}}
{%- elif m.role == 'tool' -%}
{{- '[TOOL_RESULTS]{"content": ' + (m.content | tojson) + ', "call_id": "' + m.tool_call_id + '"}[/TOOL_RESULTS]' -}}
{%- else -%}
{{- m.content + eos_token -}}
{%- endif -%}
{%- endfor -%}
"""

# Mistral's newer style: [TOOL_CALLS]name[ARGS]{...} per call
MISTRAL_ARGS = r"""
{{- bos_token -}}
{%- if tools %}{{ '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' -}}
{%- elif m.role == 'user' -%}
{{- '[INST]' + m.content + '[/INST]' -}}
{%- elif m.role == 'assistant' and m.tool_calls -%}
{%- for c in m.tool_calls -%}
{{- '[TOOL_CALLS]' + c.function.name + '[ARGS]' + (c.function.arguments | tojson) -}}
{%- endfor -%}
{{- eos_token -}}
{%- elif m.role == 'tool' -%}
{{- '[TOOL_RESULTS]' + m.content + '[/TOOL_RESULTS]' -}}
{%- else -%}
{{- m.content + eos_token -}}
{%- endif -%}
{%- endfor -%}
"""

# a template that ignores tools (ChatML, as SmolLM2's own)
NO_TOOLS = r"""
{%- for m in messages -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}
"""

TEMPLATES = {"hermes": HERMES, "llama3": LLAMA3, "mistral": MISTRAL, "mistral-args": MISTRAL_ARGS, "none": NO_TOOLS}


def with_template(src: str | os.PathLike, dst: str | os.PathLike, template: str) -> Path:
    """A copy of the GGUF `src` at `dst` whose tokenizer.chat_template is `template` (metadata and tensors as
    they are otherwise)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, suffix=".partial")
    os.close(fd)
    writer = GGUFWriter(tmp, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "tokenizer.chat_template"):
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    writer.add_chat_template(template)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return dst
