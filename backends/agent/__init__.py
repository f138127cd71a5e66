"""The node agent: its daemon, control protocol and directory layout, slot table, peer serving, the readers a
restoring process uses, and its part of protection (the slot format and the pulls that fill it)."""
