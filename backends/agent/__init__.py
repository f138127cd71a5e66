"""The node agent: its daemon, control protocol and directory layout, slot table, peer serving, the readers a
restoring process uses, and its part of protection (the pulls that build a protection slot's blocks; the slot
format itself is ``jaxckpt.protection.slot``)."""
