"""Chat templates with tool support: the pieces the families' published formats share, and
the Hermes format.

A family's own template lives in its folder and its `FamilySpec.chat_template` names it
(`baton.model.family`); each renders `tools`, assistant `tool_calls` (arguments as objects:
the templates iterate them), `tool` results and earlier turns' `reasoning_content` the way
the family's own checkpoint does (docs/agents.md), so a seeded or trained checkpoint of that
family is prompted, and answers, in the format its parser (baton/agents/parse.py) reads:

  XML_CALLS           `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>...`
                      (with XML_CALL_INSTRUCTION, TOOL_RESULTS and RENDER_CONTENT: the
                      pieces the XML-call templates share)
  HERMES_TEMPLATE     Hermes JSON calls
                      `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`

A plain chat (no tools) renders under HERMES_TEMPLATE exactly as the ChatML template did.
"""

from __future__ import annotations

XML_CALL_INSTRUCTION = (
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

# the XML call of one assistant message's tool_calls (the XML-call formats share it)
XML_CALLS = """
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
TOOL_RESULTS = """
{%- if loop.previtem and loop.previtem.role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}
{%- if not loop.last and loop.nextitem.role != "tool" %}{{- '<|im_end|>\\n' }}
{%- elif loop.last %}{{- '<|im_end|>\\n' }}{%- endif %}
"""

RENDER_CONTENT = """
{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for item in content -%}{%- if item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}
{%- elif content is none -%}
{%- else -%}{{ content }}{%- endif -%}
{%- endmacro -%}
"""

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
