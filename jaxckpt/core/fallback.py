"""When the newest step cannot be read bit for bit: fall back to an older one inside the same restore.

A restore of the newest step (``step=None``) reads each chunk from the first of its sources that gives
bytes matching the chunk's crc32c, the step's protection (a rebuild from parity or copies) among them
(``jaxckpt.core.fetch``). Only when every source of some chunk failed, or a holder vanished mid-restore, or a
manifest is corrupt, is the step lost to the job; a relaunch would then only fall back past it. So instead, in
the same ``restore()`` call:

  0) (every process) contributes its outcome (the step, and its error's class and message or None) and the
     older steps it can restore (committed, or persisted with a persistent tier), in one ``all_gather`` round
     of the ``restored`` channel (``jaxckpt.core.collective``; a single process has no round);
  1) (every process, from the same contributions) decides alike: all restored the same step -> done; a process
     met bad bytes (:data:`BAD_BYTES`) and no process failed otherwise -> the newest older step every process
     can restore (committed or persisted, or, when every failure is bytes proven bad, pinned past retention:
     protection's guard, a step adoption kept because it can be rebuilt); anything else -> every process
     raises (its own error, or one of the same class naming the process that failed);
  2) on a fallback every process restores the older step, which may itself fall back; once one is restored,
     every process forgets the steps passed over (``CheckpointEngine.forget_newer``: their numbers may be
     saved again, the numbered rounds of later steps shifted past every number used). The restore report's
     ``skipped`` says which steps were passed over and why. When no step can be restored nothing is forgotten.

A restore of an explicit step never falls back: the caller asked for that step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxckpt import errors as _errors
from jaxckpt.errors import ChecksumError, ManifestError, NoCheckpointError, StepNotFoundError

if TYPE_CHECKING:
    from jaxckpt.core.engine import CheckpointEngine

log = logging.getLogger("jaxckpt.core.fallback")

__all__ = ["BAD_BYTES", "Outcome", "agree_outcome"]

# The step's saved bytes cannot be had bit for bit: a chunk failed its checksum at every source (protection
# included), a holder vanished (StepNotFoundError, DataLossError), a manifest is corrupt.
BAD_BYTES = (ChecksumError, ManifestError, StepNotFoundError)
CHANNEL = "restored"


def is_bad_bytes(error: BaseException | None) -> bool:
    """True for an error that says the step's bytes cannot be had (not that nothing was ever committed)."""
    return isinstance(error, BAD_BYTES) and not isinstance(error, NoCheckpointError)


def is_proven_bad(error: BaseException | None) -> bool:
    """True for bytes that were had and failed their checks (a chunk's crc32c everywhere, a corrupt manifest),
    not for a holder that could not be reached, whose bytes may be intact."""
    return isinstance(error, (ChecksumError, ManifestError))


@dataclass(frozen=True)
class Outcome:
    """What every process decided after one attempt: ``fallback`` (the step to restore next) or None (done);
    ``skipped``: one line naming the step passed over, the process that could not read it, and why."""

    fallback: int | None
    skipped: str = ""
    newest_begun: int | None = None  # the newest step any process began to save (numbers to shift past)


def agree_outcome(engine: "CheckpointEngine", step: int | None, error: BaseException | None) -> Outcome:
    """One round (above) over this process's attempt at ``step``; raises what the job cannot get past."""
    # Not all_steps(): that asks the store, and a store whose agent died mid-restore would hold this process
    # back from the round while the others wait. A step the store no longer holds fails its attempt instead.
    older = [s for s in engine.restorable_steps() if step is not None and s < step]
    # The steps pinned past retention (protection's guard, adoption's rebuildable fallbacks) are candidates only
    # when every failure is bytes proven bad: when a holder went away instead (this process's own agent died
    # mid-restore, say), the newer steps' bytes may survive in its memory, and falling back would forget them
    # (the chaos run lost 4 steps so); the job relaunches then and loses nothing.
    kept = [s for s in engine.pinned_steps() if step is not None and s < step and s not in older]
    mine = [step, None if error is None else [type(error).__name__, str(error), is_bad_bytes(error),
                                              is_proven_bad(error)], older, engine.newest_begun(), kept]
    if engine.process_count == 1:
        got = [mine]
    else:
        try:
            got = engine.collective.channel(CHANNEL).all_gather("restore outcome", mine)
        except _errors.CoordinationError as e:  # a process died or is stuck: the job cannot agree on a step
            if error is not None:
                raise error from e
            raise
    failed = [(p, e) for p, (_, e, *_) in enumerate(got) if e is not None]
    if len({s for s, *_ in got}) > 1:
        # The processes do not agree on the newest step (one has nothing committed, say): never hand back a
        # torn job, and never let some processes start fresh while others hold steps. The same error everywhere.
        said = ", ".join(f"process {q}: {s if s is not None else 'nothing'}"
                         + (f" ({e[0]})" if e is not None else "") for q, (s, e, *_) in enumerate(got))
        raise _errors.CoordinationError(f"the processes' newest steps differ ({said}); restore an explicit step "
                                        f"or restart the job") from error
    if not failed:
        return Outcome(None)
    p, (kind, message, *_) = failed[0]
    if not all(e[2] for _, e in failed):
        _raise(error, p, kind, message, got[p][0])
    proven = all(len(e) > 3 and e[3] for _, e in failed)
    common = None
    for _, _, held, _, *more in got:
        candidates = set(held) | (set(more[0]) if proven and more else set())
        common = candidates if common is None else common & candidates
    fallback = max(common or (), default=None)
    if fallback is None:
        _raise(error, p, kind, message, got[p][0], "; no older step is held by every process")
    line = f"step {got[p][0]}: process {p} could not read it ({kind}: {message}); fell back to step {fallback}"
    log.warning("%s", line)
    begun = [c[3] for c in got if c[3] is not None]
    return Outcome(int(fallback), line, max(begun) if begun else None)


def _raise(error: BaseException | None, p: int, kind: str, message: str, step: Any, why: str = "") -> None:
    """This process's own error as it is (``why`` is logged), or one of the failed process's class naming it."""
    if error is not None:
        if why:
            log.error("step %s: %s%s", step, error, why)
        raise error
    raise _errors.named(kind, f"process {p} of the restore of step {step} failed: {message}{why}")
