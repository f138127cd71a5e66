"""The persistent directory as a holder of snapshots: the restore driver reads a persisted step like any other.

Kind ``persistent`` (``jaxckpt.core.sources``), ranked last: a step in memory is read from memory, and a chunk no
memory holder gives good bytes for (corrupt, or its holder gone) is read from here when the step is persisted,
in the same restore; a step only persisted is read from here whole. Fallback to an older step, forgetting the
newer ones, the restore report, the collective and the verification are the driver's, whatever tier the bytes
come from (``jaxckpt.core.restore``).

A persisted step holds every saving process's manifest (``jaxckpt.persistent.directory``); a read of a range of
process ``q``'s snapshot buffer is the box of each chunk it covers, read from Orbax's array through TensorStore
(the parameter name the index records), and is checked against the chunk's crc32c by the chunk reader. Orbax and
TensorStore are imported at the first such read: listing the steps and reading their indexes needs neither.
"""
from __future__ import annotations

import bisect
import json
import logging
import os
import threading
from typing import Any

import numpy as np
from etils import epath

from jaxckpt.core import manifest as mf
from jaxckpt.core.checksum import crc32c
from jaxckpt.core.sources import HeldEntry, Holder, Opened
from jaxckpt.errors import ManifestError, StepNotFoundError
from jaxckpt.persistent.directory import STATE_ITEM, StepIndex, persisted_steps, read_index, step_dir

log = logging.getLogger("jaxckpt.persistent.holder")

__all__ = ["PersistentHolder"]


class _Step:
    """One persisted step opened for reading: its index, manifests and (lazily) its Orbax arrays."""

    def __init__(self, directory: epath.Path, step: int, index: StepIndex) -> None:
        self.step, self.index = step, index
        self.item = step_dir(directory, step) / STATE_ITEM
        self.manifests: dict[int, tuple[bytes, mf.Manifest]] = {}
        for raw in index.manifests:
            m = mf.decode(raw, source=f"persisted step {step} manifest")
            self.manifests[m.process] = (raw, m)
        self._opened: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._spec: tuple[bool, bool, Any] | None = None

    def entries(self) -> list[HeldEntry]:
        return [HeldEntry(m.step, m.process, m.process_count, m.layout, crc32c(raw))
                for raw, m in self.manifests.values()]

    def array(self, path: str) -> Any:
        """The TensorStore of array ``path`` (opened once per step)."""
        import orbax.checkpoint as ocp  # here, not above: only a read from disk pays for the import
        import tensorstore as ts

        with self._lock:
            got = self._opened.get(path)
            if got is not None:
                return got
            name = self.index.names.get(path)
            if name is None:
                raise StepNotFoundError(f"{path}: persisted step {self.step} has no Orbax array for it")
            if self._spec is None:
                meta = json.loads((self.item / "_METADATA").read_text())
                ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.item)
                self._spec = (ocdbt, bool(meta.get("use_zarr3", False)),
                              ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt))
            ocdbt, zarr3, context = self._spec
            info = ocp.type_handlers.ParamInfo(name=name, parent_dir=self.item, use_zarr3=zarr3, ts_context=context)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt)
            got = self._opened[path] = ts.open(spec, context=context, open=True, read=True).result()
            return got


class _Reads:
    """Reads ranges of process ``q``'s snapshot buffer of one persisted step, chunk by chunk."""

    def __init__(self, step: _Step, manifest: mf.Manifest) -> None:
        self._step = step
        chunks = sorted((c.offset, c, a.path) for a in manifest.arrays for c in a.chunks if c.nbytes)
        self._starts = [o for o, _, _ in chunks]
        self._chunks = [(c, p) for _, c, p in chunks]

    def __call__(self, offset: int, nbytes: int) -> memoryview:
        out = bytearray(nbytes)
        pos, end = offset, offset + nbytes
        i = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(self._chunks) or not self._starts[i] <= pos < self._starts[i] + self._chunks[i][0].nbytes:
                raise StepNotFoundError(f"persisted step {self._step.step}: bytes {pos}..{end} of the snapshot are "
                                        f"not in any saved chunk")
            chunk, path = self._chunks[i]
            data = self._box(path, chunk)
            lo = pos - chunk.offset
            hi = min(chunk.nbytes, end - chunk.offset)
            out[pos - offset:pos - offset + hi - lo] = data[lo:hi]
            pos += hi - lo
            i += 1
        return memoryview(out)

    def _box(self, path: str, chunk: mf.ChunkMeta) -> memoryview:
        where = f"{path}: persisted step {self._step.step} chunk {chunk.box.start}..{chunk.box.stop}"
        try:
            arr = self._step.array(path)
            got = arr[tuple(slice(lo, hi) for lo, hi in zip(chunk.box.start, chunk.box.stop))].read().result()
        except StepNotFoundError:
            raise
        except (ValueError, OSError) as e:  # TensorStore reports a missing or unreadable array as ValueError
            raise StepNotFoundError(f"{where} cannot be read from {self._step.item}: {e}") from None
        return memoryview(np.ascontiguousarray(got).reshape(-1).view(np.uint8))


class PersistentHolder(Holder):
    """The persisted steps of ``directory`` as a holder (see the module docstring)."""

    kind = "persistent"
    node = "persistent"

    def __init__(self, directory: epath.PathLike) -> None:
        self.directory = epath.Path(directory)
        self.name = f"persistent directory {self.directory}"
        self._steps: dict[int, tuple[Any, _Step | None]] = {}  # step -> (stamp of its index, the opened step)
        self._warned: set[int] = set()
        self._lock = threading.Lock()

    def _stamp(self, step: int) -> Any:
        try:
            st = os.stat(str(step_dir(self.directory, step)))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _open_step(self, step: int) -> _Step | None:
        """The step as persisted now (re-read when its directory changed: a step persisted again after a restore
        passed over it); None for a step without a jaxckpt index."""
        stamp = self._stamp(step)
        with self._lock:
            got = self._steps.get(step)
            if got is not None and got[0] == stamp:
                return got[1]
        try:
            opened: _Step | None = _Step(self.directory, step, read_index(self.directory, step))
        except (StepNotFoundError, ManifestError) as e:
            if step not in self._warned:
                self._warned.add(step)
                log.warning("%s: step %d is not readable by jaxckpt: %s", self.name, step, e)
            opened = None
        with self._lock:
            self._steps[step] = (stamp, opened)
        return opened

    def _current(self) -> list[tuple[int, _Step]]:
        """Every persisted step jaxckpt can read, ascending, opened; the cache forgets the others."""
        steps = persisted_steps(self.directory)
        with self._lock:
            for s in [s for s in self._steps if s not in steps]:
                del self._steps[s]
        return [(s, opened) for s in steps if (opened := self._open_step(s)) is not None]

    def steps(self) -> list[int]:
        """The persisted steps jaxckpt can read (finalized, with an index), ascending."""
        return [s for s, _ in self._current()]

    def held(self) -> list[HeldEntry]:
        return [e for _, opened in self._current() for e in opened.entries()]

    def open(self, process: int, step: int) -> Opened:
        step_dir(self.directory, step)  # StepError for anything but a step number, before it names a path
        opened = self._open_step(step) if step in persisted_steps(self.directory) else None
        if opened is None or process not in opened.manifests:
            raise StepNotFoundError(f"step {step} of process {process} is not in the {self.name} (persisted: "
                                    f"{persisted_steps(self.directory) or 'none'})")
        raw, m = opened.manifests[process]
        return Opened(raw, _Reads(opened, m), lend=lambda: True)  # each read is memory of its own
