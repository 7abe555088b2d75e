"""Public API keys: who may call Router.Generate (and the HTTP API) when keys are configured."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from baton import envs
from baton.errors import ConfigError

ENV_API_KEY = envs.API_KEY.name


def load_api_keys(api_keys_file: str, environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """Keys from `router.api_keys_file` (one a line; blank lines and `#` comments skipped)
    plus `BATON_API_KEY`; empty: the public API is open."""
    keys = set()
    if api_keys_file:
        try:
            lines = Path(api_keys_file).read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"router.api_keys_file {api_keys_file!r} cannot be read: {e}") from e
        keys.update(k.strip() for k in lines if k.strip() and not k.strip().startswith("#"))
        if not keys:
            raise ConfigError(f"router.api_keys_file {api_keys_file!r} holds no key; put one "
                              "key a line, or remove the setting to leave the API open")
    if environ.get(ENV_API_KEY, "").strip():
        keys.add(environ[ENV_API_KEY].strip())
    short = [k for k in keys if len(k) < 8]
    if short:
        raise ConfigError(f"{len(short)} API key(s) are shorter than 8 characters; use longer "
                          "random keys")
    return frozenset(keys)
