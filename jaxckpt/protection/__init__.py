"""Protection against the loss of a node: the plan (which redundancy each chunk gets), XOR parity, the trainer's
runtime that builds a committed step's redundancy, and the rebuild of a lost node's chunks. Numpy only."""
