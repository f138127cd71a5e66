"""Tooling, never imported by the library, the Orbax handler or the node agent: benchmarks (``bench``), the fault
injector (``chaos``) and the multi-process launcher behind ``jaxckpt launch`` and the tests."""
