"""The JAX front end's side of the front-end protocol (``jaxckpt.frontend.protocol.Frontend``).

Leaves to records: ``jaxckpt.jax.snapshot`` (a plan per state layout, the views a save takes now). Arrays from
host boxes: ``jaxckpt.jax.restore.restore_tree``. Coordinator: the JAX coordination service in a job of several
processes (``jaxckpt.jax.coordination``). Collective: ``jaxckpt.jax.gather``.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from jaxckpt.config import Config
from jaxckpt.core import manifest as mf
from jaxckpt.core.coordination import Coordinator, LocalCoordinator
from jaxckpt.core.engine import CheckpointEngine, ShardReads
from jaxckpt.core.fetch import ChunkReader
from jaxckpt.core.restore import Gather
from jaxckpt.jax.gather import gather_for
from jaxckpt.jax.restore import restore_tree
from jaxckpt.jax.snapshot import Saver, TreeLayout

__all__ = ["JaxFrontend"]


class JaxFrontend:
    """Pytrees of ``jax.Array`` (and numpy arrays, numpy scalars, plain values) on any mesh."""

    framework = "jax"
    persists = True

    def __init__(self, config: Config) -> None:
        self.config = config
        self.saver = Saver()  # layouts: what save() computes once per tree structure and shardings

    def coordinator(self) -> Coordinator:
        if jax.process_count() > 1:
            from jaxckpt.jax.coordination import JaxCoordinator
            return JaxCoordinator()
        return LocalCoordinator()

    def layout(self, state: Any) -> tuple[TreeLayout, list[Any]]:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        return self.saver.layout(leaves, treedef, tree=state), leaves

    def take(self, layout: TreeLayout, devices: list[frozenset[int]], leaves: list[Any], owned: bool
             ) -> Callable[[], list[ShardReads]]:
        return self.saver.pins(layout, devices, leaves, owned)

    def build(self, target: Any, manifests: list[mf.Manifest], reader: ChunkReader, *, step: int, process: int,
              gather: Gather | None) -> Any:
        return restore_tree(target, manifests, reader, step=step, process=process, gather=gather)

    def gather(self, engine: CheckpointEngine, target: Any, config: Config) -> Gather | None:
        return gather_for(engine, target, config)

    def persist_note(self, layout: TreeLayout, leaves: list[Any]) -> tuple[Any, list[Any]]:
        return layout.treedef, layout.leaf_list(leaves)
