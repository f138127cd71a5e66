"""The persistent directory's format: Orbax's step layout, plus the index jaxckpt reads its steps back through.

Each persisted step is what ``ocp.CheckpointManager`` writes for ``args=Composite(default=StandardSave(state),
...)``::

    <persistent_dir>/<step>/_CHECKPOINT_METADATA
    <persistent_dir>/<step>/default/...          the state: ocp.StandardCheckpointer's format for that pytree
    <persistent_dir>/<step>/extra/metadata       small non-array state as JSON (only when saved with extra=)
    <persistent_dir>/<step>/jaxckpt/metadata     the index: every saving process's manifest, and the Orbax
                                                 parameter name of every array path (JSON)

so a plain Orbax program reads it (``ocp.StandardCheckpointer().restore(dir / str(step) / "default", target)``),
and jaxckpt reads it as one more holder of the step's snapshots (``jaxckpt.persistent.holder``): the manifests
say which chunk lives where, the chunks are read as boxes of Orbax's arrays and checked by their crc32c. Orbax
writes a step under ``<step>.orbax-checkpoint-tmp`` and renames it when complete: a crash mid-persist leaves
only that temporary name, which every listing here (and Orbax's) ignores.

Nothing here imports Orbax: the steps are listed from the directory itself, as Orbax lists them
(``persisted_steps``), so that a ``Checkpointer`` whose restore is served from memory (after a node loss, say)
never pays Orbax's and TensorStore's import; only writing a step (``writer``) and reading bytes from disk
(``holder``) import them.
"""
from __future__ import annotations

import base64
import json
import logging
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
from etils import epath

from jaxckpt.errors import ManifestError, StepError, StepNotFoundError, brief

log = logging.getLogger("jaxckpt.persistent.directory")

__all__ = ["COMMIT_SUCCESS", "EXTRA_ITEM", "INDEX_ITEM", "STATE_ITEM", "TMP_SUFFIX", "StepIndex", "index_item", "persisted_steps",
           "read_index", "remove_temporaries", "step_dir"]

STATE_ITEM = "default"  # ocp.CheckpointManager's item name for a single StandardSave
EXTRA_ITEM = "extra"
INDEX_ITEM = "jaxckpt"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's TMP_DIR_SUFFIX (a test holds them equal)
COMMIT_SUCCESS = "commit_success.txt"  # what marks a finished step on GCS, where Orbax does not rename
INDEX_FORMAT, INDEX_VERSION = "jaxckpt-persisted", 1


def step_dir(directory: epath.PathLike, step: Any) -> epath.Path:
    """``<directory>/<step>``; anything but a non-negative int (a float, a bool, a path like "../x") is refused
    with StepError before it names a path."""
    if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
        raise StepError(f"step must be a non-negative int, got {brief(step)}")
    return epath.Path(directory) / str(int(step))


def _finalized_step(path: epath.Path) -> int | None:
    """The step of ``path`` when it is a finalized step directory, else None; Orbax's own test, which
    ``ocp.path.step.checkpoint_steps`` applies to each entry: a directory (a link to one counts) named ``<step>``
    or ``<prefix>_<step>``, not a temporary (``TMP_SUFFIX`` in its name) and, on GCS, holding ``COMMIT_SUCCESS``.
    A name Orbax's listing raises on (``_12``) is no step here."""
    name = path.name
    if not (name.isdigit() or name.split("_")[-1].isdigit()) or not path.is_dir():
        return None
    if path.as_posix().startswith("gs://"):
        if not (path / COMMIT_SUCCESS).exists():
            return None
    elif TMP_SUFFIX in name:
        return None
    if name.isdigit():
        return int(name) if name.isdecimal() else None
    m = re.fullmatch(r"(.+)_(\d+)", name)
    return int(m.group(2)) if m else None


def persisted_steps(directory: epath.PathLike) -> list[int]:
    """Finalized steps in ``directory``, ascending (temporary, half-written ones are not steps)."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    return sorted(s for p in directory.iterdir() if (s := _finalized_step(p)) is not None)


def remove_temporaries(directory: epath.PathLike) -> list[str]:
    """Delete the ``<step>.orbax-checkpoint-tmp*`` leftovers of persists that crashed; returns their names."""
    directory = epath.Path(directory)
    if not directory.exists():
        return []
    gone = []
    for p in directory.iterdir():
        if TMP_SUFFIX in p.name:
            shutil.rmtree(str(p), ignore_errors=True)
            gone.append(p.name)
    if gone:
        log.warning("removed %d half-written persisted step(s) from %s: %s", len(gone), directory, sorted(gone))
    return gone


@dataclass(frozen=True)
class StepIndex:
    """What jaxckpt needs to read a persisted step back: every saving process's encoded manifest (by process) and
    the Orbax parameter name of every array path."""

    manifests: tuple[bytes, ...]
    names: dict[str, str]


def index_item(manifests: list[bytes], names: dict[str, str]) -> dict:
    """The JSON of the ``jaxckpt`` item (Orbax's ``JsonSave``): manifests as base64 msgpack, never pickle."""
    return {"format": INDEX_FORMAT, "version": INDEX_VERSION, "names": dict(names),
            "manifests": [base64.b64encode(m).decode("ascii") for m in manifests]}


def read_index(directory: epath.PathLike, step: int) -> StepIndex:
    """The index of persisted ``step``; StepNotFoundError when the step has none (persisted by plain Orbax, or by
    a jaxckpt that wrote no index), ManifestError when it is malformed."""
    path = step_dir(directory, step) / INDEX_ITEM / "metadata"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise StepNotFoundError(f"step {step} in the persistent directory {directory} has no jaxckpt index "
                                f"({path}): it was not persisted by jaxckpt; read it with Orbax") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path}: not a jaxckpt index ({e})") from None
    if not isinstance(raw, dict) or raw.get("format") != INDEX_FORMAT or raw.get("version") != INDEX_VERSION:
        raise ManifestError(f"{path}: not a jaxckpt index of version {INDEX_VERSION}")
    names, manifests = raw.get("names"), raw.get("manifests")
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()) \
            or not isinstance(manifests, list) or not all(isinstance(m, str) for m in manifests):
        raise ManifestError(f"{path}: malformed jaxckpt index")
    try:
        return StepIndex(tuple(base64.b64decode(m, validate=True) for m in manifests), names)
    except ValueError as e:
        raise ManifestError(f"{path}: malformed manifest in the jaxckpt index ({e})") from None
