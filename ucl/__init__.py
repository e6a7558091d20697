"""ucl: the Universal Checkpoint Language and its I/O engine."""
