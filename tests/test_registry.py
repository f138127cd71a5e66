"""The store registry: lazy imports by name, clobber rules, a read-only view, entry points."""
import subprocess
import sys
import textwrap

import pytest

from jaxckpt import registry
from jaxckpt.backends.memory import MemoryStore
from jaxckpt.errors import BackendNotFoundError


@pytest.fixture(autouse=True)
def restore_registry():
    known, loaded, eps = dict(registry._known), dict(registry._loaded), registry._entry_points_loaded
    yield
    registry._known.clear()
    registry._known.update(known)
    registry._loaded.clear()
    registry._loaded.update(loaded)
    registry._entry_points_loaded = eps


class OtherStore(MemoryStore):
    name = "other"


def test_lookup_is_lazy():
    code = textwrap.dedent("""
        import sys
        import jaxckpt
        from jaxckpt import Config
        from jaxckpt.registry import get_store_class, registered_stores
        Config(store="memory")
        registered_stores()
        assert "jaxckpt.backends.memory" not in sys.modules, "imported before use"
        assert "jax" not in sys.modules, "import jaxckpt imported jax"
        cls = get_store_class("memory")
        assert "jaxckpt.backends.memory" in sys.modules and cls.__name__ == "MemoryStore"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_memory_is_built_in():
    assert registry.get_store_class("memory") is MemoryStore
    assert registry.get_store_class("memory") is MemoryStore  # cached


def test_the_earlier_name_registers_in_the_same_registry():
    """``jaxckpt.core.registry`` (the registry's earlier home) still registers stores that Config then accepts."""
    from jaxckpt import Config
    from jaxckpt.core.registry import get_store_class, register_store

    register_store("earlier", OtherStore)
    assert get_store_class("earlier") is OtherStore is registry.get_store_class("earlier")
    assert Config(store="earlier").store == "earlier"


def test_unknown_name_lists_known_stores():
    with pytest.raises(BackendNotFoundError, match=r"no store named 'tape' \(known: .*memory"):
        registry.get_store_class("tape")


def test_missing_dependency_says_what_to_install():
    registry.register_store("needsdep", "jaxckpt_no_such_module_xyz.store:Store")
    with pytest.raises(BackendNotFoundError, match="'needsdep' needs 'jaxckpt_no_such_module_xyz'"):
        registry.get_store_class("needsdep")


def test_missing_class_in_an_importable_module():
    registry.register_store("noattr", "jaxckpt.backends.memory:NoSuchStore")
    with pytest.raises(BackendNotFoundError, match="noattr.*NoSuchStore"):
        registry.get_store_class("noattr")


def test_register_a_class_and_a_string():
    registry.register_store("other", OtherStore)
    assert registry.get_store_class("other") is OtherStore
    registry.register_store("other2", f"{__name__}:OtherStore")
    assert registry.get_store_class("other2") is OtherStore


def test_register_refuses_silent_overwrite():
    registry.register_store("other", OtherStore)
    with pytest.raises(BackendNotFoundError, match="'other' is already registered.*clobber=True"):
        registry.register_store("other", MemoryStore)
    assert registry.get_store_class("other") is OtherStore
    with pytest.raises(BackendNotFoundError, match="'memory' is already registered"):
        registry.register_store("memory", OtherStore)
    assert registry.get_store_class("memory") is MemoryStore


def test_register_same_target_again_is_a_no_op():
    registry.register_store("other", OtherStore)
    registry.register_store("other", OtherStore)
    spec = "jaxckpt.backends.memory:MemoryStore"
    registry.register_store("memory", spec)  # before first use...
    registry.get_store_class("memory")
    registry.register_store("memory", spec)  # ...and after it
    assert registry.get_store_class("memory") is MemoryStore


def test_clobber_replaces():
    registry.register_store("other", OtherStore)
    registry.register_store("other", MemoryStore, clobber=True)
    assert registry.get_store_class("other") is MemoryStore
    registry.get_store_class("memory")
    registry.register_store("memory", OtherStore, clobber=True)
    assert registry.get_store_class("memory") is OtherStore


def test_registered_view_is_read_only():
    view = registry.registered_stores()
    assert "memory" in view
    with pytest.raises(TypeError):
        view["x"] = OtherStore
    with pytest.raises(TypeError):
        del view["memory"]
    registry.register_store("other", OtherStore)
    assert view["other"] is OtherStore  # a live view, not a copy


def test_module_colon_class_name_resolves_without_registration():
    from jaxckpt import Config
    name = f"{__name__}:OtherStore"
    assert Config(store=name).store == name
    assert registry.get_store_class(name) is OtherStore


def test_entry_points_register_third_party_stores(tmp_path, monkeypatch):
    dist = tmp_path / "jaxckpt_fake_store-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxckpt-fake-store\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[jaxckpt.stores]\nfakestore = {__name__}:OtherStore\nmemory = {__name__}:OtherStore\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._entry_points_loaded = False
    assert registry.get_store_class("fakestore") is OtherStore
    assert registry.get_store_class("memory") is MemoryStore  # an entry point never shadows a built-in
    assert "fakestore" in registry.registered_stores()


# ------------------------------------------------------------------------- parts (the peer transport)
@pytest.fixture
def restore_parts():
    parts = {g: dict(v) for g, v in registry._parts.items()}
    loaded = dict(registry._loaded_parts)
    yield
    registry._parts.clear()
    registry._parts.update(parts)
    registry._loaded_parts.clear()
    registry._loaded_parts.update(loaded)


def test_the_peer_transport_is_a_part_imported_only_when_asked():
    code = textwrap.dedent("""
        import sys
        import jaxckpt.core.engine
        from jaxckpt.registry import get_part
        assert "jaxckpt.backends.peers" not in sys.modules and "zmq" not in sys.modules, "imported before use"
        cls = get_part("peers", "default")
        assert cls.__module__ == "jaxckpt.backends.peers" and cls.__name__ == "Peers"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_parts_register_refuse_overwrite_and_name_what_is_missing(restore_parts):
    with pytest.raises(BackendNotFoundError, match=r"no peers named 'x' \(known: default\)"):
        registry.get_part("peers", "x")
    registry.register_part("peers", "x", OtherStore)
    assert registry.get_part("peers", "x") is OtherStore
    with pytest.raises(BackendNotFoundError, match="already registered"):
        registry.register_part("peers", "x", MemoryStore)
    registry.register_part("peers", "x", "no_such_module_jaxckpt:Peers", clobber=True)
    with pytest.raises(BackendNotFoundError, match="needs 'no_such_module_jaxckpt'"):
        registry.get_part("peers", "x")
    registry.register_part("peers", "y", "jaxckpt.backends.memory:Nope")
    with pytest.raises(BackendNotFoundError, match="names no class"):
        registry.get_part("peers", "y")
