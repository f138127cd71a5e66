"""``jaxckpt.core.registry``: the registry's earlier name, kept for stores registered through it. The registry is
``jaxckpt.registry`` (a layer below ``jaxckpt.config``, which checks ``Config.store`` against it, and below the
core, which builds its parts from it)."""
from jaxckpt.registry import get_part, get_store_class, register_part, register_store, registered_stores

__all__ = ["get_part", "get_store_class", "register_part", "register_store", "registered_stores"]
