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


class RunFailedError(RlplexError):
    """A run failed while it ran, not because of its input (a process died, a wait timed out,
    an error inside a rank): commands exit with code 1, not the user-error code 2."""


class WorkerDiedError(RunFailedError):
    """A child process (sampler worker, copier, rank) died; the message names it and its exit code."""


class WaitTimeoutError(RunFailedError):
    """A blocking wait ran past its deadline; the message says what was awaited."""


class JobSpecError(ConfigError):
    """A control-plane job declaration is invalid; the message names the role and the field."""


class PlacementError(RlplexError):
    """A job's roles do not fit the cluster's capacity; the message names the role that does not fit."""


class JobFailedError(RunFailedError):
    """A control-plane job failed (prepare, restart budget, ...); the message carries the cause."""


class JobInterruptedError(RlplexError):
    """A job was stopped by a signal (SIGINT, SIGTERM, SIGHUP); its report is written and it can
    be continued. `signum` gives the command its exit code, 128 + signum."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


class MasterRunningError(ConfigError):
    """A job folder already has a live master; the message names it (pid, host, since when)."""


class NodeFailedError(RlplexError):
    """A control-plane node failed or a call to it failed; the message names the node."""


class IllegalTransitionError(RlplexError):
    """A state machine was asked for a transition its table does not allow."""


class MultiRunError(RlplexError):
    """The multi-run manager was misused or its shared state is inconsistent."""


class RunConfigError(ConfigError):
    """A run's `control/orch.toml` is missing, unreadable, too big or invalid; the message says why."""


class RunDirGoneError(MultiRunError):
    """A run directory no longer exists (deleted while training); nothing was written for it."""


class HookMismatchError(MultiRunError):
    """Ranks registered different creation/deletion hooks, so running them would deadlock or diverge."""


class CheckpointError(MultiRunError):
    """A per-run checkpoint could not be written or read; the previous stable checkpoint is untouched."""


class AdapterError(RlplexError):
    """A multi-LoRA adapter slot, rank, id or exported adapter is invalid; the message names it."""


class ExportError(MultiRunError):
    """A run's adapter cannot be exported: no such run or step, or a destination that is taken."""


class ModelLoadError(ConfigError):
    """A model or tokenizer named by a config cannot be loaded; the message names it and says why."""


class DeviceError(ConfigError):
    """A config asks for a device this machine does not have (CUDA without a GPU)."""


class InferenceError(RlplexError):
    """The inference engine (a vLLM server or the in-process generator) failed a request."""


class InferenceUnavailableError(InferenceError):
    """No inference server answered within the reconnect deadline; the message names the endpoint."""


class AdapterRefusedError(InferenceError):
    """The inference server refused to load an adapter (rank too high, corrupt file); the message says why."""


class UnsafeFileError(RlplexError, OSError):
    """A file rlplex was asked to read is not a regular file inside its folder, or is too big.

    Also an `OSError`, so code that already treats unreadable files as `OSError` handles it.
    """
