"""The protocol core, numpy only: boxes, manifests, checksums, planning, coordination, the engine, restore sources.

No module here imports jax, torch, zmq or ``jaxckpt.backends``: front ends and stores plug in from outside.
"""
