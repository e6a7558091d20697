"""Writing steps: the step writer (the commit protocol every writer follows), ``ucl.save``, and the
asynchronous :class:`ucl.CheckpointManager` (staging, step kinds, persisting, commit, retention,
distributed coordination).
"""
