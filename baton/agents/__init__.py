"""Agents' API on top of the engine: chat messages with tools for the template (messages.py),
the model's tool calls and reasoning read from its text (parse.py), constrained decoding with
llguidance (grammar.py, specs.py). docs/agents.md says how they fit."""
