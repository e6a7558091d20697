"""Tools over repositories: validate, gc, compact, diff, import/export, and the ``ucl`` command."""
