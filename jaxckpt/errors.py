"""Exceptions raised by jaxckpt. Every message names the array path, step, peer or key concerned."""
from __future__ import annotations

import reprlib

_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxdict, _BRIEF.maxlist, _BRIEF.maxtuple = 2, 2, 3, 3
_BRIEF.maxstring, _BRIEF.maxother = 40, 60


def brief(value: object) -> str:
    """``value`` for an error message, bounded: its type and a shortened repr (a whole state passed where a step
    was expected must not print every leaf)."""
    return f"{type(value).__name__} {_BRIEF.repr(value)}"


class JaxckptError(Exception):
    """Base class of every error jaxckpt raises on purpose."""


class ConfigError(JaxckptError, ValueError):
    """A configuration value, file or environment variable is unknown or ill-typed."""


class BackendNotFoundError(JaxckptError, LookupError):
    """No store backend is registered under the requested name, or its dependency is missing."""


class ManifestError(JaxckptError, ValueError):
    """A manifest is malformed, truncated, or written by an unsupported format version."""


class UnsupportedLeafError(JaxckptError, TypeError):
    """A pytree leaf has a type jaxckpt cannot snapshot."""


class UnsupportedTypeError(UnsupportedLeafError, ValueError):
    """A leaf jaxckpt cannot snapshot, saved through Orbax's args: Orbax's ``ValueError('Unsupported type: ...')``."""


class EmptyItemError(JaxckptError, ValueError):
    """An Orbax save of a tree without leaves (or of None): Orbax's ``ValueError('Found empty item.')``."""


class TargetMismatchError(JaxckptError, ValueError):
    """The restore target differs from the saved state in structure, shape or dtype."""


class StepError(JaxckptError, ValueError):
    """A save was asked for a step that is not newer than the newest saved one."""


class StepNotFoundError(JaxckptError, LookupError):
    """The requested step is not held (or was never saved)."""


class StepOutOfRangeError(StepError, StepNotFoundError):
    """A step number no store can hold (past ``engine.MAX_STEP``): a bad argument, and a step that is not held."""


class NoCheckpointError(StepNotFoundError):
    """Restore was asked for while nothing has been committed."""


class BudgetExceededError(JaxckptError, MemoryError):
    """A new snapshot does not fit the configured memory budget; committed snapshots are kept."""


class ChecksumError(JaxckptError):
    """Stored bytes do not match the checksum recorded at save time."""


class PlanError(JaxckptError, ValueError):
    """A save or restore plan is inconsistent (chunks out of bounds, overlapping, or not covering)."""


class CommitError(JaxckptError):
    """A step could not be committed by every process (a process died or timed out)."""


class ClosedError(JaxckptError, RuntimeError):
    """The checkpointer or store was used after close()."""


class PeerError(JaxckptError, ConnectionError):
    """A peer refused a request (wrong token), sent a malformed reply, or did not answer in time."""


class PeerTimeoutError(PeerError):
    """The peer did not answer in time (it may be dead), as opposed to answering with a refusal."""


class PeerUnreachableError(PeerTimeoutError):
    """Nothing accepted a connection at the peer's address (a dead agent's stale address, most likely)."""


class PeerHandshakeError(PeerUnreachableError):
    """A CURVE handshake with the peer's address failed: the server there does not hold the key published for
    that address (an impostor, or another server that took a dead one's port), or it refused this job's key."""


class CapabilityError(JaxckptError, LookupError):
    """A store was asked for a capability (``jaxckpt.core.capabilities``) its class does not declare."""


class LaunchError(JaxckptError, RuntimeError):
    """A launched multi-process job could not start, or was used outside a launched process."""


class StoreUnavailableError(JaxckptError, ConnectionError):
    """The service holding this process's snapshots (the node agent) cannot be reached; the save is skipped."""


class AgentError(JaxckptError, RuntimeError):
    """The node agent refused a request (wrong job, process already connected, malformed message)."""


class DataLossError(StepNotFoundError):
    """Lost nodes took bytes of a step that its protection cannot rebuild; names the step and the missing boxes.

    ``step``, ``lost_nodes`` and ``missing`` (array path -> tuple of boxes) carry the same facts for callers that
    fall back to an older step or the persistent tier.
    """

    def __init__(self, message: str, *, step: int | None = None, lost_nodes: tuple = (),
                 missing: dict | None = None) -> None:
        super().__init__(message)
        self.step, self.lost_nodes, self.missing = step, tuple(lost_nodes), dict(missing or {})


class CoordinationError(CommitError):
    """A cross-process round failed: a process raised in it or did not arrive in time (raised on every process).

    ``processes`` are the processes that failed, ``round_name`` and ``round_number`` the round
    (``jaxckpt.core.collective``); the message names all of them. ``errors`` maps each failed process to the
    class name of the exception it raised ("" when it did not arrive in time); on the process that raised, the
    exception itself is the ``__cause__``.
    """

    def __init__(self, message: str, *, processes: tuple[int, ...] = (), round_name: str = "",
                 round_number: int = -1, errors: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.processes, self.round_name, self.round_number = tuple(processes), round_name, round_number
        self.errors = dict(errors or {})

    @property
    def missed(self) -> bool:
        """A process missed the round (did not arrive, or ran other rounds) rather than raised in it."""
        return "" in self.errors.values()

    def hinted(self, hint: str) -> "CoordinationError":
        """The same error with `` (hint)`` added to its message."""
        return CoordinationError(f"{self} ({hint})", processes=self.processes, round_name=self.round_name,
                                 round_number=self.round_number, errors=self.errors)


def named(kind: str, message: str, default: type[JaxckptError] = CoordinationError) -> JaxckptError:
    """An error of the class named ``kind`` in this module carrying ``message`` (``default`` when there is none):
    how another process's error is raised here, its class kept (messages and classes cross processes, never
    pickled exceptions)."""
    cls = globals().get(kind)
    if isinstance(cls, type) and issubclass(cls, JaxckptError):
        try:
            return cls(message)
        except TypeError:  # a class that carries more than a message
            pass
    return default(message)
