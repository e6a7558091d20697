"""Reading committed steps: :class:`ucl.Checkpoint` and its lazy tensors, plain box reads, delta-chain
reads, and the one ``load`` / ``load_into`` (any tensors, any target configuration).
"""
