"""Error types shared by every role; each maps to one gRPC status at the edges."""


class BatonError(Exception):
    """Base class for errors Baton raises on purpose."""


class InvalidRequestError(BatonError, ValueError):
    """The request itself is bad (maps to INVALID_ARGUMENT)."""


class ConfigError(BatonError, ValueError):
    """A config file or checkpoint is unusable; the message names the field."""


class CapacityError(BatonError, RuntimeError):
    """Pools cannot hold what was asked (maps to RESOURCE_EXHAUSTED)."""


class TransferError(BatonError, RuntimeError):
    """A KV/state handoff failed, was refused, or its lease expired."""
