"""Orbax's own pytree handler and ``SnapshotHandler`` run on the same case, side by side (a test helper).

A :class:`Pair` drives both handlers through one route an Orbax user takes (a bare handler, an
``ocp.AsyncCheckpointer``, an ``ocp.CheckpointManager``) with one kind of Orbax args (``StandardSave`` /
``StandardRestore`` or ``PyTreeSave`` / ``PyTreeRestore``); each call returns both :class:`Outcome` s, so a test
compares jaxckpt's answer with Orbax's answer of the same run, and a change of Orbax's behaviour shows up as a
failing comparison. Also imported by the subprocesses of tests that need a job with other devices.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint._src.metadata import pytree_metadata_options

from jaxckpt.orbax import SnapshotHandler

ROUTES = ("handler", "async", "manager")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of Orbax args and the Orbax handler that takes them."""

    name: str
    save: type
    restore: type
    handler: type


KINDS = {"standard": Kind("standard", ocp.args.StandardSave, ocp.args.StandardRestore, ocp.StandardCheckpointHandler),
         "pytree": Kind("pytree", ocp.args.PyTreeSave, ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler)}


@dataclasses.dataclass
class Outcome:
    """What one call gave: a value, or the exception it raised; for a save, ``where`` it raised: at the "save"
    call or at the "wait" for it to finish (an asynchronous failure)."""

    value: Any = None
    error: BaseException | None = None
    where: str = ""

    def get(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"expected a value, got {type(self.error).__name__}: {self.error}") from self.error
        return self.value


def attempt(fn: Callable[[], Any]) -> Outcome:
    try:
        return Outcome(fn())
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return Outcome(error=e)


class Side:
    """One handler driven through one route, in a directory of its own."""

    def __init__(self, handler: Any, kind: Kind, route: str, root: epath.Path) -> None:
        self.handler, self.kind, self.route, self.root = handler, kind, route, epath.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.ckptr = self.mngr = None
        self.phase = ""  # of the save in progress: "save", then "wait"
        if route == "async":
            self.ckptr = ocp.AsyncCheckpointer(handler)
        elif route == "manager":
            registry = ocp.DefaultCheckpointHandlerRegistry()
            registry.add("state", kind.save, handler)
            registry.add("state", kind.restore, handler)
            self.mngr = ocp.CheckpointManager(self.root, handler_registry=registry, options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True))
        elif route != "handler":
            raise ValueError(route)

    def save(self, step: int, args: Any) -> None:
        path = self.root / str(step)
        self.phase = "save"
        if self.route == "handler":
            path.mkdir()
            self.handler.save(path, args=args)  # synchronous: its errors are the save's
            self.handler.finalize(path)
        elif self.route == "async":
            self.ckptr.save(path, args=args)
            self.phase = "wait"
            self.ckptr.wait_until_finished()
        else:
            self.mngr.save(step, args=ocp.args.Composite(state=args))
            self.phase = "wait"
            self.mngr.wait_until_finished()

    def restore(self, step: int, args: Any) -> Any:
        if self.route == "handler":
            return self.handler.restore(self.root / str(step), args=args)
        if self.route == "async":
            return self.ckptr.restore(self.root / str(step), args=args)
        return self.mngr.restore(step, args=ocp.args.Composite(state=args))["state"]

    def metadata(self, step: int) -> Any:
        if self.route == "handler":
            return self.handler.metadata(self.root / str(step))
        if self.route == "async":
            return self.ckptr.metadata(self.root / str(step)).item_metadata
        return self.mngr.item_metadata(step)["state"]

    def close(self) -> None:
        for c in (self.ckptr, self.mngr):
            if c is not None:
                c.close()


class Pair:
    """Orbax's handler of ``kind`` (legacy container types, its default) and ``SnapshotHandler`` (the same
    choice: ``rich_types=False``) on one route: every call runs on both and returns (Orbax's, jaxckpt's)."""

    def __init__(self, kind: str, route: str, root: epath.PathLike, checkpointer: Any) -> None:
        self.kind = KINDS[kind]
        options = pytree_metadata_options.PyTreeMetadataOptions(support_rich_types=False)
        root = epath.Path(root)
        self.orbax = Side(self.kind.handler(pytree_metadata_options=options), self.kind, route, root / "orbax")
        self.ours = Side(SnapshotHandler(checkpointer, rich_types=False), self.kind, route, root / "jaxckpt")

    def _both(self, call: Callable[[Side], Any]) -> tuple[Outcome, Outcome]:
        return attempt(lambda: call(self.orbax)), attempt(lambda: call(self.ours))

    def save(self, step: int, item: Any, **kw: Any) -> tuple[Outcome, Outcome]:
        outcomes = self._both(lambda side: side.save(step, self.kind.save(item, **kw)))
        for side, outcome in zip((self.orbax, self.ours), outcomes):
            outcome.where = side.phase if outcome.error is not None else ""
        return outcomes

    def restore(self, step: int, item: Any = None, **kw: Any) -> tuple[Outcome, Outcome]:
        return self._both(lambda side: side.restore(step, self.kind.restore(item, **kw)))

    def metadata(self, step: int) -> tuple[Outcome, Outcome]:
        return self._both(lambda side: side.metadata(step))

    def close(self) -> None:
        self.orbax.close()
        self.ours.close()


# ------------------------------------------------------------------------------------------------ comparing
def assert_same_tree(ref: Any, got: Any) -> None:
    """``got`` is ``ref`` as a user sees it: the same containers (``None``, ``MaskedNode`` and empty nodes
    included), the same leaf types, and arrays equal bit for bit with the same dtype, shape and sharding."""
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(ref)
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    assert got_def == ref_def, f"tree structure: Orbax {ref_def}, jaxckpt {got_def}"
    for (kp, r), g in zip(ref_leaves, got_leaves):
        where = jax.tree_util.keystr(kp)
        if isinstance(r, jax.Array):
            assert isinstance(g, jax.Array), f"{where}: Orbax jax.Array, jaxckpt {type(g).__name__}"
            assert (g.dtype, g.shape) == (r.dtype, r.shape), f"{where}: {g.dtype}{g.shape} vs {r.dtype}{r.shape}"
            assert g.sharding == r.sharding, f"{where}: sharding {g.sharding} vs Orbax's {r.sharding}"
            if jax.dtypes.issubdtype(r.dtype, jax.dtypes.prng_key):
                assert jax.random.key_impl(g) == jax.random.key_impl(r), where
                r, g = jax.random.key_data(r), jax.random.key_data(g)
            assert_bits(r, g, where)
        elif isinstance(r, np.ndarray):
            assert type(g) is np.ndarray, f"{where}: Orbax numpy, jaxckpt {type(g).__name__}"
            assert_bits(r, g, where)
        else:
            assert type(g) is type(r) and g == r, f"{where}: Orbax {r!r}, jaxckpt {g!r}"


def assert_bits(ref: Any, got: Any, where: str = "") -> None:
    ref, got = np.asarray(ref), np.asarray(got)
    assert (got.dtype, got.shape) == (ref.dtype, ref.shape), f"{where}: {got.dtype}{got.shape} vs {ref.dtype}{ref.shape}"
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8), err_msg=where)


def assert_same_error(ref: Outcome, got: Outcome, words: str, jaxckpt_error: type) -> BaseException:
    """Both raised, at the same point (a save: at the call, or at the wait for it); Orbax's error is a ValueError
    saying ``words``; jaxckpt's is ``jaxckpt_error``, an instance of Orbax's error class, whose message starts
    with ``words`` and goes on with its own text."""
    assert ref.error is not None, f"Orbax did not raise (gave {ref.value!r})"
    assert got.error is not None, f"jaxckpt did not raise (gave {got.value!r}); Orbax raised {ref.error!r}"
    assert got.where == ref.where, f"jaxckpt raised at the {got.where}, Orbax at the {ref.where}: {got.error!r}"
    assert isinstance(ref.error, ValueError) and words in str(ref.error), repr(ref.error)
    assert isinstance(got.error, type(ref.error)) and isinstance(got.error, jaxckpt_error), repr(got.error)
    assert str(got.error).startswith(words) and len(str(got.error)) > len(words), str(got.error)
    return got.error


def assert_same_metadata(ref: Any, got: Any) -> None:
    """Two metadata trees (``TreeMetadata.tree``) alike: containers, leaf types (``ArrayMetadata``,
    ``ScalarMetadata``, ``StringMetadata``, None), shapes, dtypes and shardings."""
    is_meta = lambda x: isinstance(x, ocp.metadata.Metadata)  # noqa: E731
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(ref, is_leaf=is_meta)
    got_leaves, got_def = jax.tree_util.tree_flatten(got, is_leaf=is_meta)
    assert got_def == ref_def, f"metadata structure: Orbax {ref_def}, jaxckpt {got_def}"
    for (kp, r), g in zip(ref_leaves, got_leaves):
        where = jax.tree_util.keystr(kp)
        assert type(g) is type(r), f"{where}: Orbax {type(r).__name__}, jaxckpt {type(g).__name__}"
        if not isinstance(r, ocp.metadata.ArrayMetadata):  # StringMetadata: a name only
            continue
        assert (tuple(g.shape), np.dtype(g.dtype)) == (tuple(r.shape), np.dtype(r.dtype)), \
            f"{where}: {g.shape} {g.dtype} vs Orbax's {r.shape} {r.dtype}"
        assert g.sharding == r.sharding, f"{where}: sharding {g.sharding} vs Orbax's {r.sharding}"
