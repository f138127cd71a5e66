"""Protection against the loss of a node: the plan (which redundancy each chunk gets), XOR parity, the trainer's
runtime that builds a committed step's redundancy, and the rebuild of a lost node's chunks. Numpy only."""

# Pseudo process index of a trainer's protection slots: PROTECT_BASE + process. Far above any job's process count,
# and within the nine digits the agent's file names give a process index. Here, not in ``slot`` (which re-exports
# it): the node agent tells protection slots apart by it and must not import numpy for a number.
PROTECT_BASE = 500_000_000
