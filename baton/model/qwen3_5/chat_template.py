"""Qwen3.5's chat template with tools (`FamilySpec.chat_template`): tools as JSON lines in
<tools>, XML calls, thinking on unless `enable_thinking` is false (docs/agents.md)."""

from baton.model.tool_templates import RENDER_CONTENT, TOOL_RESULTS, XML_CALL_INSTRUCTION, XML_CALLS

TEMPLATE = RENDER_CONTENT + """
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
{{- '<|im_start|>system\\n' }}
{{- "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\n""" + XML_CALL_INSTRUCTION + """" }}
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
""" + XML_CALLS + """
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
""" + TOOL_RESULTS + """
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
