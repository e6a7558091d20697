"""Writing steps: the step writer (the commit protocol every writer follows), ``ucl.save``, and the
asynchronous :class:`ucl.CheckpointManager` (``manager``), built from one module per concern: ``planning``,
``staging``, ``kinds`` (full, delta or gradient steps), ``shards`` (persisting), ``commit``, ``retention``,
``collectives`` (distributed coordination), ``handle`` and ``job``.
"""
