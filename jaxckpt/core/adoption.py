"""Start-up adoption: which steps a store that survives the process (a node agent) kept from an earlier run of
this job become this run's, decided once in ``CheckpointEngine.__init__`` (the engine applies the decision).

Own steps are the held ones this process saved as the same process of a job of the same size (their manifests
say so); the others were saved by another incarnation of the job (say 4 processes, where we are 2) and stay with
the agents as restore sources.

One process: its newest ``keep`` own steps become committed. Several: one ``reduce`` round ``adopt`` of the
``main`` channel (jaxckpt.core.collective; O(processes) at process 0, like the commit protocol):
  0) (every process) contributes its own held steps (and those it sees as protected, rebuildable);
  1) (process 0)     reduces them to the newest ``keep`` steps every process holds (and the guard);
  2) (every process) gets that result, or the round's CoordinationError if a process did not answer.
With node agents, the catalog also finds every agent and agrees on the newest step whose snapshot every process
can obtain from them (jaxckpt.core.catalog), whatever job size saved it: that is ``latest_step()`` when it is
newer. With protection, the newest step every process holds whose protection is complete
(``RebuildHolder.protected_steps``, agreed likewise) is kept and held too, as ``Protector._announce`` holds the
newest protected step: until a newer step is protected, a node lost now is rebuilt from it. So is a newer step
that can only be rebuilt (a node of it was lost, say the one just restored): until a newer step is protected it
is the only fallback should the newest step turn out unreadable. Every process then deletes its own held steps
outside those (newer ones were not committed everywhere) and any held step newer than the restorable one, and
numbers its next save after it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxckpt.core import manifest as mf
from jaxckpt.errors import StepNotFoundError

if TYPE_CHECKING:
    from jaxckpt.core.engine import CheckpointEngine

log = logging.getLogger("jaxckpt.core.adoption")


@dataclass(frozen=True)
class Adoption:
    """What a starting engine takes over from its store (see the module docstring)."""

    held: tuple[int, ...]  # every step the store held at start-up
    agreed: tuple[int, ...]  # the newest ``keep`` steps every process holds: committed from now on
    newest: int | None  # the step the next save is numbered after (None: nothing adopted)
    holds: tuple[tuple[int, bool], ...]  # (step, protection complete?) kept beyond ``keep``: guard and fallbacks
    delete: tuple[int, ...]  # held steps to delete now
    # the manifest bytes of ``newest`` this process saved and their decoding (None: not its own): a relaunch restores
    # that step next, and its restore need not decode them again (a 4,096-leaf state's: 130-170 ms here)
    newest_manifest: "tuple[bytes, mf.Manifest] | None" = field(default=None, compare=False, repr=False)


def decide(engine: "CheckpointEngine") -> Adoption:
    """The adoption of ``engine``'s store at start-up; with several processes, collectively (one round)."""
    watch = engine.startup
    with watch.stage("own steps"):  # what the store holds, and whose: the held manifests decoded
        held = engine.store.steps()
        decoded = _own_steps(engine, held)
    own = list(decoded)
    restorable = None
    if engine.catalog.uses_agents:
        main = engine.collective.channel("main")
        with watch.stage("discover agents"):
            engine.catalog.discover(main)
        # its scan is the one protected_steps() reads; its parts are stages of their own (agent clients, agent
        # listings, registered listings, restorable round)
        restorable = engine.catalog.agree_latest(main, watch)
    with watch.stage("agree held"):
        holder = engine.protection.holder if engine.protection is not None else None
        protected = holder.protected_steps() if holder is not None else []
        rebuildable = holder.rebuildable_steps() if holder is not None else []
        if engine.process_count == 1:
            agreed = own[-engine.config.keep:]
            guard = max(set(own) & set(protected), default=None)
        else:
            agreed, guard, rebuildable = _agree_held(engine, own, protected, rebuildable)
    if guard is not None and restorable is not None and guard > restorable:
        guard = None
    # Fallbacks newer than guard that can be rebuilt though not protected on every node (a node of theirs was
    # lost): the newest one older than what the job restores now (should that be unreadable), and that one
    # itself when it is such a step (retention would drop it as soon as the next step commits).
    newest = max([*agreed, *([restorable] if restorable is not None else [])], default=None)
    older = max((s for s in rebuildable if (newest is None or s < newest) and (guard is None or s > guard)),
                default=None)
    fallbacks = [s for s in (older, newest) if s is not None and s in rebuildable and s not in protected and
                 (guard is None or s > guard)]
    kept = set(agreed) | {s for s in (restorable, guard, *fallbacks) if s is not None}
    delete = tuple(s for s in held if (s in own and s not in kept) or (restorable is not None and s > restorable))
    holds = tuple((s, complete) for s, complete in ((guard, True), *((f, False) for f in fallbacks)) if s is not None)
    mine = decoded.get(newest)
    return Adoption(tuple(held), tuple(agreed), newest, holds, delete, mine if mine and mine[1] else None)


def _own_steps(engine: "CheckpointEngine", held: list[int]) -> dict[int, tuple[bytes, mf.Manifest | None]]:
    """The held steps this process saved as process ``process_index`` of ``process_count`` processes, in order,
    each with its manifest's bytes; the newest readable one's decoded too (the step a relaunch restores, checked
    whole before it is adopted), the others only as far as whose they are (most are deleted next, and a 4,096-leaf
    manifest takes a tenth of a second to decode: a restore of an older one decodes it, and falls back if it must)."""
    out: dict[int, tuple[bytes, mf.Manifest | None]] = {}
    newest = True
    for s in sorted(held, reverse=True):
        try:
            raw = engine.store.manifest(s)  # the bytes stay unread: most held steps are deleted next
        except StepNotFoundError:
            continue
        if raw is None:
            continue
        source = f"step {s} manifest of process {engine.process_index}"
        try:
            m = mf.decode(raw, source=source) if newest else None
            whose = (m.process, m.process_count) if m is not None else mf.owner(raw, source=source)
        except mf.ManifestError as e:
            log.warning("process %d: held step %d is unreadable (%s); not adopted", engine.process_index, s, e)
            continue
        if whose == (engine.process_index, engine.process_count):
            out[s] = (raw, m)
            newest = False
    return dict(sorted(out.items()))


def _agree_held(engine: "CheckpointEngine", held: list[int], protected: list[int], rebuildable: list[int]
                ) -> tuple[list[int], int | None, list[int]]:
    """(the newest ``keep`` steps every process holds, the newest step every process holds and sees as
    protected or None, the steps every process sees as rebuildable)."""
    keep = engine.config.keep

    def common(contributions: list) -> list:
        held_all, prot, rb = (set(map(int, held)), set(map(int, protected)), set(map(int, rebuildable)))
        for h, pr, r in contributions[1:]:  # ValueError (not three lists, another version): fails the round
            held_all &= set(map(int, h))
            prot &= set(map(int, pr))
            rb &= set(map(int, r))
        return [sorted(held_all)[-keep:], max(held_all & prot, default=None), sorted(rb)[-16:]]
    # A process that does not answer in time fails the round on every process (CoordinationError).
    out = engine.collective.channel("main").reduce("adopt", [list(held), list(protected), list(rebuildable)],
                                                   common)
    steps, guard, rebuildable = out
    return [int(s) for s in steps], None if guard is None else int(guard), [int(s) for s in rebuildable]
