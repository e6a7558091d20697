"""The shipped test kit: models, helpers and reference emulations for ucl's own tests and for users' tests.

- :mod:`ucl.testing.gpt`: a small deterministic GPT for the demo, the benchmarks and the resharding tests.
- :mod:`ucl.testing.dist`: run a function on N real torch.distributed (gloo) processes.
- :mod:`ucl.testing.layout_strategies`: hypothesis strategies for layouts and meshes.
- :mod:`ucl.testing.layout_reference`: an independent emulation of the layout copy rule (what each rank
  holds, and the logical tensors back from it), the reference the planner is checked against.
"""
