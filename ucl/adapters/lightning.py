"""PyTorch Lightning checkpoints through ucl: a ``CheckpointIO`` plugin (synchronous or asynchronous).

``Trainer(plugins=[UclCheckpointIO()])``: every checkpoint Lightning writes (``ModelCheckpoint``,
``trainer.save_checkpoint``) goes through ucl, and every resume (``fit(ckpt_path="last" | path)``) reads
it back. Lightning names checkpoints by path (``checkpoints/epoch=0-step=8.ckpt``, ``last.ckpt``); each
such path is one ucl repository (a directory) and each save to it one committed step of it, numbered by
the checkpoint's ``global_step`` (or the next number when a path is saved again at the same step):

- ``last.ckpt``, saved again and again, gains a step per save and keeps the newest ``keep_last``; a
  save killed at any moment leaves the previous step as the latest committed one, which is what
  ``load_checkpoint`` reads, so ``fit(ckpt_path="last")`` resumes from the latest committed ucl step;
- ``ModelCheckpoint``'s lookups (``fs.exists``, ``fs.ls`` of the folder for ``last*.ckpt``,
  ``fs.modified``) see the directory as they saw the file (its mtime is renewed at each save);
- ``remove_checkpoint`` (top-k rotation) waits for the path's pending save, then deletes the repository.

The checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``,
``hyper_parameters``, ...) is stored by :mod:`ucl.adapters.values`: tensors as ucl arrays (bit-exact),
JSON values in the step's structure tree, ``OrderedDict`` / ``AttributeDict`` classes and
``_metadata`` recorded, other objects as ``torch.save`` bytes loaded back under Lightning's
``weights_only``.

``UclCheckpointIO(async_save=True)`` uses the engine's own asynchrony: ``save_checkpoint`` returns once
the state is copied into staging memory (training may then change its tensors), the step is written and
committed in the background, a later save to the same path waits for a staging slot, and ``teardown``
(end of ``fit``), ``load_checkpoint`` and ``remove_checkpoint`` of that path wait for it to commit; a
failure surfaces at the next call. Lightning's own ``AsyncCheckpointIO(UclCheckpointIO())`` works too (a
thread calling the synchronous plugin on a clone).

Under a multi-process strategy that replicates the model (``strategy="ddp"``) Lightning calls only
global rank 0's ``CheckpointIO``, with the whole checkpoint: that rank's manager saves alone
(``CheckpointManager(no_dist=True)``: no collective the other ranks would have to join), asynchronously
and with the same retention as on one process. Lightning's sharded strategies (FSDP's
``state_dict_type="sharded"``, DeepSpeed) write their own files without a ``CheckpointIO``: save such
state with ``CheckpointManager`` directly (``ucl.layout`` for FSDP, DeepSpeed and Megatron shards).

Lightning is imported when this module is (``import ucl`` never imports it).
"""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO

from ucl.adapters import values
from ucl.options import DEFAULT_WRITE, WriteOptions
from ucl.read.load import load
from ucl.write.handle import SaveHandle
from ucl.write.manager import CheckpointManager

__all__ = ["UclCheckpointIO"]


def _cpu(storage: Any, loc: str) -> Any:  # TorchCheckpointIO's default: every tensor on the CPU
    return storage


class UclCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` writing each checkpoint path as a ucl repository.

    Parameters
    ----------
    async_save
        False: ``save_checkpoint`` returns once the step is committed. True: once it is staged (the
        write and commit run in the background; see the module docstring).
    keep_last
        Steps kept in each path's repository (the newest; the next step commits before an old one goes).
    compression, delta, options, writer_threads
        Passed to :class:`ucl.CheckpointManager` (``delta=True`` stores repeated saves of a path, such as
        ``last.ckpt``, as bit-exact deltas).
    """

    def __init__(self, *, async_save: bool = False, keep_last: int = 1, compression: str | None = None,
                 delta: Any = None, options: WriteOptions = DEFAULT_WRITE, writer_threads: int = 4) -> None:
        super().__init__()
        self.async_save = async_save
        self.keep_last = keep_last
        self._kw: dict[str, Any] = {"compression": compression, "delta": delta, "options": options,
                                    "writer_threads": writer_threads}
        self._managers: dict[str, CheckpointManager] = {}
        self._last: dict[str, int] = {}
        self._pending: dict[str, list[SaveHandle]] = {}
        self._lock = threading.RLock()

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (got "
                            f"{storage_options!r}); pass fsspec options through a URL path instead")
        key = os.fspath(path)
        state = values.encode(checkpoint)
        gs = checkpoint.get("global_step")
        with self._lock:
            self._raise_failed(key)
            mgr = self._manager(key)
            step = self._next_step(key, gs, mgr)
            handle = mgr.save(step, state)
            self._last[key] = step
            _touch(key)
            if self.async_save:
                self._pending.setdefault(key, []).append(handle)
                return
        handle.result()

    def load_checkpoint(self, path: Any, map_location: Any = _cpu, weights_only: bool | None = None) -> dict[str, Any]:
        key = os.fspath(path)
        self._drain(key)
        if not os.path.exists(key) and "://" not in key:
            raise FileNotFoundError(f"Checkpoint file not found: {key}")
        return values.decode(load(key), map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        key = os.fspath(path)
        with self._lock:
            mgr = self._managers.pop(key, None)
            self._pending.pop(key, None)
            self._last.pop(key, None)
        if mgr is not None:
            mgr.close(None)
        if os.path.islink(key) or os.path.isfile(key):
            os.remove(key)
        elif os.path.isdir(key):
            shutil.rmtree(key)

    def teardown(self) -> None:
        """Wait for every pending save to commit and close the repositories (end of ``fit``)."""
        with self._lock:
            managers, self._managers = self._managers, {}
            self._pending, self._last = {}, {}
        first: BaseException | None = None
        for mgr in managers.values():
            try:
                mgr.close(None)
            except BaseException as e:  # noqa: BLE001 - close them all, raise the first failure
                first = first or e
        if first is not None:
            raise first

    # -- helpers ----------------------------------------------------------------------------------
    def _manager(self, key: str) -> CheckpointManager:
        mgr = self._managers.get(key)
        if mgr is None:
            # under a multi-process strategy only global rank 0 calls a CheckpointIO, with the whole
            # (replicated) checkpoint: it saves alone (no_dist), the other ranks issue no collective
            mgr = CheckpointManager(key, keep_last=self.keep_last, no_dist=_distributed(), **self._kw)
            self._managers[key] = mgr
        return mgr

    def _next_step(self, key: str, global_step: Any, mgr: CheckpointManager | None) -> int:
        last = self._last.get(key)
        if last is None:
            latest = mgr.latest_step() if mgr is not None else _latest(key)
            last = -1 if latest is None else latest
        if isinstance(global_step, int) and not isinstance(global_step, bool) and global_step > last:
            return global_step
        return last + 1

    def _raise_failed(self, key: str) -> None:
        for h in self._pending.get(key, []):
            if h.done():
                h.result()
        if key in self._pending:
            self._pending[key] = [h for h in self._pending[key] if not h.done()]

    def _drain(self, key: str) -> None:
        with self._lock:
            pending = self._pending.pop(key, [])
        for h in pending:
            h.result()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _latest(key: str) -> int | None:
    from ucl.format.repository import Repository

    if not os.path.isdir(key) and "://" not in key:
        return None
    return Repository.open(key).latest()


def _touch(key: str) -> None:
    """Renew the repository directory's mtime: ``fit(ckpt_path="last")`` picks the newest ``last*.ckpt``."""
    if os.path.isdir(key):
        os.utime(key)
