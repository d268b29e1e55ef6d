"""The torchpass exception hierarchy.

Every error a user or admin can meet is a subclass of TorchpassError and its
message is one line saying what is wrong and what to do about it. Callers at
the edges (CLI, daemons, the SPANK-started coordinator) catch TorchpassError
and print the message; anything else is a bug and keeps its traceback.
"""


class TorchpassError(Exception):
    """Base class: a failure with a one-line, actionable message."""


class ConfigError(TorchpassError):
    """A config file, flag, environment variable or option value is invalid."""


class DependencyError(TorchpassError):
    """A required system tool or library is missing or too old (criu, slurm, munge)."""


class ProtocolError(TorchpassError):
    """A message on the wire is malformed, of an unknown type or version."""


class AuthError(TorchpassError):
    """A request could not be authenticated or the caller may not do this."""


class UnreachableError(TorchpassError):
    """A peer (tpassd, coordinator, slurmctld) did not answer in time."""


class RemoteError(TorchpassError):
    """A peer answered with an error reply; carries its stable code."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} ({code})")
        self.code = code
        self.remote_message = message


class SlurmError(TorchpassError):
    """A Slurm command or API call failed."""


class CheckpointError(TorchpassError):
    """A snapshot (CRIU dump, CUDA checkpoint) or a restore failed."""


class DevclusterError(TorchpassError):
    """The local development cluster could not be brought up or down."""
