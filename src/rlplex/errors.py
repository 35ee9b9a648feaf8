"""One exception root for everything rlplex raises on purpose.

Catch `RlplexError` to handle any rlplex failure; the subclasses say what went wrong.
"""

from __future__ import annotations


class RlplexError(Exception):
    """Root of every error rlplex raises deliberately."""


class ConfigError(RlplexError):
    """A config file or value is invalid. The message names the file, the field and the value."""


class EnvironmentSpecError(ConfigError):
    """An environment id or environment option cannot be used."""


class SnapshotError(RlplexError):
    """A snapshot is missing, corrupt, or belongs to an incompatible config."""


class WorkerDiedError(RlplexError):
    """A child process (sampler worker, copier, rank) died; the message names it and its exit code."""


class WaitTimeoutError(RlplexError):
    """A blocking wait ran past its deadline; the message says what was awaited."""


class AdapterError(RlplexError):
    """A multi-LoRA adapter slot, rank, id or exported adapter is invalid; the message names it."""
