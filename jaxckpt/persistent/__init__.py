"""The persistent tier: committed snapshots written to ``Config.persistent_dir`` in the standard Orbax format
(``writer``), and read back by the restore driver as one more holder of snapshots (``holder``).

Its own layer: below the front ends (which hand it their arrays from host boxes to write with), above the core
and the stores. ``directory`` is the format on disk.
"""
from jaxckpt.persistent.directory import TMP_SUFFIX, persisted_steps
from jaxckpt.persistent.holder import PersistentHolder
from jaxckpt.persistent.writer import Persister

__all__ = ["Persister", "PersistentHolder", "TMP_SUFFIX", "persisted_steps"]
