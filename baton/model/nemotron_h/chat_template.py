"""Nemotron 3's chat template with tools (`FamilySpec.chat_template`): tools as XML, XML
calls, every assistant turn with a `<think>` prefix, `truncate_history_thinking`
(docs/agents.md)."""

from baton.model.tool_templates import RENDER_CONTENT, TOOL_RESULTS, XML_CALL_INSTRUCTION, XML_CALLS

TEMPLATE = RENDER_CONTENT + """
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
{{- "\\n</tools>\\n\\n""" + XML_CALL_INSTRUCTION + """" }}
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
""" + XML_CALLS + """
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
""" + TOOL_RESULTS + """
{%- else %}{{- raise_exception('Unexpected message role.') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{%- if enable_thinking %}{{- '<|im_start|>assistant\\n<think>\\n' }}
{%- else %}{{- '<|im_start|>assistant\\n<think></think>' }}{%- endif %}
{%- endif %}
"""
"""Nemotron 3's format (the published Nano template's structure; docs/agents.md)."""
