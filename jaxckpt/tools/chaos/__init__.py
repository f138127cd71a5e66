"""``jaxckpt chaos``: seeded fault injection over a real multi-process job (run), its faults, proxy, trainer and report."""
