"""The shipped test kit: models, helpers and fault injection for ucl's own tests and for users' tests.

:mod:`ucl.testing.gpt`: a small deterministic GPT for the demo, the benchmarks and the resharding tests.
"""
