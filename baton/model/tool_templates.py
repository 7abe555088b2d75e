"""Chat templates with tool support, in the model families' published formats.

Each renders `tools`, assistant `tool_calls` (arguments as objects: the templates iterate them),
`tool` results and earlier turns' `reasoning_content` the way the family's own checkpoint does
(docs/agents.md), so a seeded or trained checkpoint of that family is prompted, and answers,
in the format its parser (baton/agents/parse.py) reads:

  QWEN3_5_TEMPLATE    Qwen3.5 / 3.6: tools as JSON lines in <tools>, XML calls
                      `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>...`,
                      thinking on unless `enable_thinking` is false
  NEMOTRON3_TEMPLATE  Nemotron 3 Nano / Super: tools as XML, the same XML calls, every
                      assistant turn with a `<think>` prefix, `truncate_history_thinking`
  HERMES_TEMPLATE     Qwen3-Next (Instruct) / Qwen3-2507: Hermes JSON calls
                      `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`

A plain chat (no tools) renders under HERMES_TEMPLATE exactly as the ChatML template did.
"""

from __future__ import annotations

_XML_CALL_INSTRUCTION = (
    "If you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\n"
    "value_1\\n</parameter>\\n<parameter=example_parameter_2>\\nThis is the value for the "
    "second parameter\\nthat can span\\nmultiple lines\\n</parameter>\\n</function>\\n"
    "</tool_call>\\n\\n<IMPORTANT>\\nReminder:\\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within "
    "<tool_call></tool_call> XML tags\\n- Required parameters MUST be specified\\n- You may "
    "provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\\n- If there is no function call available, answer the "
    "question like normal with your current knowledge and do not tell the user about "
    "function calls\\n</IMPORTANT>"
)

# the XML call of one assistant message's tool_calls (Qwen3.5 and Nemotron 3 share it)
_XML_CALLS = """
{%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{%- if loop.first %}
{%- if content|trim %}{{- '\\n\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- else %}{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- endif %}
{%- else %}{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- endif %}
{%- if tool_call.arguments is defined %}
{%- for args_name, args_value in tool_call.arguments|items %}
{{- '<parameter=' + args_name + '>\\n' }}
{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
{{- args_value }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{%- endif %}
"""

# consecutive tool results merge into one user turn of <tool_response> blocks
_TOOL_RESULTS = """
{%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
{%- if not loop.last and loop.nextitem.role != "tool" %}{{- '<|im_end|>\\n' }}
{%- elif loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}
"""

_RENDER_CONTENT = """
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}{%- if item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}
{%- elif content is none -%}
{%- else -%}{{ content }}{%- endif -%}
{%- endmacro -%}
"""

QWEN3_5_TEMPLATE = _RENDER_CONTENT + """
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
{{- '<|im_start|>system\\n' }}
{{- "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\n""" + _XML_CALL_INSTRUCTION + """" }}
{%- if messages[0].role == 'system' %}
{%- set content = render_content(messages[0].content)|trim %}
{%- if content %}{{- '\\n\\n' + content }}{%- endif %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + render_content(messages[0].content)|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}
{%- set content = render_content(message.content)|trim %}
{%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
{%- set content = render_content(message.content)|trim %}
{%- if message.role == "system" %}
{%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
{%- elif message.role == "user" %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- set reasoning_content = reasoning_content|trim %}
{%- if loop.index0 > ns.last_query_index %}
{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + content }}
{%- endif %}
""" + _XML_CALLS + """
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
""" + _TOOL_RESULTS + """
{%- else %}{{- raise_exception('Unexpected message role.') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""
"""Qwen3.5's format (the published Qwen3.5 template's structure; docs/agents.md)."""

NEMOTRON3_TEMPLATE = _RENDER_CONTENT + """
{%- macro render_extra_keys(json_dict, handled_keys) -%}
{%- if json_dict is mapping -%}
{%- for json_key in json_dict if json_key not in handled_keys -%}
{%- if json_dict[json_key] is mapping or (json_dict[json_key] is sequence and json_dict[json_key] is not string) -%}
{{- '\\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe) ~ '</' ~ json_key ~ '>' -}}
{%- else -%}
{{- '\\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string) ~ '</' ~ json_key ~ '>' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set enable_thinking = enable_thinking if enable_thinking is defined else true %}
{%- set truncate_history_thinking = truncate_history_thinking if truncate_history_thinking is defined else true %}
{%- set ns = namespace(last_user_idx=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user_idx = loop.index0 %}{%- endif %}{%- endfor %}
{%- if messages and messages[0].role == 'system' %}
{%- set system_message = render_content(messages[0].content)|trim %}
{%- set loop_messages = messages[1:] %}
{%- set offset = 1 %}
{%- else %}
{%- set system_message = '' %}
{%- set loop_messages = messages %}
{%- set offset = 0 %}
{%- endif %}
{{- '<|im_start|>system\\n' }}
{%- if system_message %}{{- system_message }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
{%- if system_message %}{{- '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" }}
{%- for tool in tools %}
{%- if tool.function is defined %}{%- set tool = tool.function %}{%- endif %}
{{- '\\n<function>\\n<name>' ~ tool.name ~ '</name>' }}
{%- if tool.description is defined and tool.description %}{{- '\\n<description>' ~ (tool.description | trim) ~ '</description>' }}{%- endif %}
{{- '\\n<parameters>' }}
{%- if tool.parameters is defined and tool.parameters is mapping and tool.parameters.properties is defined and tool.parameters.properties is mapping %}
{%- for param_name, param_fields in tool.parameters.properties|items %}
{{- '\\n<parameter>\\n<name>' ~ param_name ~ '</name>' }}
{%- if param_fields.type is defined %}{{- '\\n<type>' ~ (param_fields.type | string) ~ '</type>' }}{%- endif %}
{%- if param_fields.description is defined %}{{- '\\n<description>' ~ (param_fields.description | trim) ~ '</description>' }}{%- endif %}
{%- if param_fields.enum is defined %}{{- '\\n<enum>' ~ (param_fields.enum | tojson | safe) ~ '</enum>' }}{%- endif %}
{{- render_extra_keys(param_fields, ['name', 'type', 'description', 'enum']) }}
{{- '\\n</parameter>' }}
{%- endfor %}
{%- endif %}
{%- if tool.parameters is defined and tool.parameters is mapping %}
{{- render_extra_keys(tool.parameters, ['type', 'properties']) }}
{%- endif %}
{{- '\\n</parameters>' }}
{{- render_extra_keys(tool, ['type', 'name', 'description', 'parameters']) }}
{{- '\\n</function>' }}
{%- endfor %}
{{- "\\n</tools>\\n\\n""" + _XML_CALL_INSTRUCTION + """" }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
{%- set content = render_content(message.content)|trim %}
{%- if message.role == "system" %}{{- raise_exception('System message must be at the beginning.') }}
{%- elif message.role == "user" %}
{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content|trim %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1]|trim %}
{%- set content = content.split('</think>')[-1]|trim %}
{%- endif %}
{%- if truncate_history_thinking and (loop.index0 + offset) < ns.last_user_idx %}{%- set reasoning = '' %}{%- endif %}
{%- if reasoning %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n' + content }}
{%- else %}{{- '<|im_start|>assistant\\n<think></think>' + content }}{%- endif %}
""" + _XML_CALLS + """
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
""" + _TOOL_RESULTS + """
{%- else %}{{- raise_exception('Unexpected message role.') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{%- if enable_thinking %}{{- '<|im_start|>assistant\\n<think>\\n' }}
{%- else %}{{- '<|im_start|>assistant\\n<think></think>' }}{%- endif %}
{%- endif %}
"""
"""Nemotron 3's format (the published Nano template's structure; docs/agents.md)."""

HERMES_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{%- elif not message.content %}{{- '\\n' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
"""Hermes JSON calls, as Qwen3-Next-80B-A3B-Instruct and Qwen3-2507 prompt them."""

FAMILY_TEMPLATES = {"qwen3_5": QWEN3_5_TEMPLATE, "qwen3_5_moe": QWEN3_5_TEMPLATE,
                    "qwen3_next": HERMES_TEMPLATE, "nemotron_h": NEMOTRON3_TEMPLATE}
"""The family's own format, for a checkpoint that ships a template of that family (the
trained models); the embedded tiny model keeps its one-line template (baton/model/
chat_template.py), which calls tools in the XML format too."""
