"""LocalStore and the local readers on a hostile filesystem (spec/core.md §3, §8.4).

- Reads refuse anything that is not a regular file (a FIFO would block forever, a device node never
  end, a directory is no document) with ``not_a_file``, without blocking, and bound what they read.
- Every path, read or written, that resolves through a symlink outside the root is refused with
  ``invalid_name``; a symlink loop too. Deleting a key that is itself a symlink removes the link only.
- A failure to create a directory (no inodes left, a path component that is a file) is a WriteError
  naming the path, never a raw OSError.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.fs import snapshot
from ucl.errors import InvalidNameError, LimitExceededError, NotAFileError, UCLError, WriteError
from ucl.io.ranges import RangeReader
from ucl.io.stores.local import LocalStore

TIMEOUT = 5.0


def bounded(fn, *args, fifo: Path | None = None, timeout: float = TIMEOUT):
    """``fn(*args)`` in a daemon thread: its result, or its exception raised here; a call that does not
    end within ``timeout`` fails the test (and a reader blocked on ``fifo`` is released)."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        if fifo is not None:
            release_fifo(fifo)
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout} s (it blocks)")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("value")


def release_fifo(path: Path) -> None:
    """Unblock readers blocked opening or reading a FIFO (a writer opens and closes it)."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


def make_special(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:  # a /dev/zero: reads never end
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))


def can_mknod(tmp: Path) -> str | None:
    try:
        os.mknod(tmp / ".probe", stat.S_IFCHR | 0o600, os.makedev(1, 5))
    except OSError as e:
        return f"cannot make a device node here ({e.strerror}): needs root"
    os.unlink(tmp / ".probe")
    return None


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    (tmp_path / "repo").mkdir()
    return LocalStore(str(tmp_path / "repo"))


# -- special files ---------------------------------------------------------------------------------
READS = {
    "read": lambda s, k: s.read(k),
    "read_bounded": lambda s, k: s.read_bounded(k, 1 << 20),
    "read_range": lambda s, k: s.read_range(k, 0, 16),
    "readinto": lambda s, k: s.readinto(k, 0, [memoryview(bytearray(16))]),
    "size": lambda s, k: s.size(k),
    "ranges_buffered": lambda s, k: RangeReader(direct=False).read(s.local_path(k), 0, 16),
    "ranges_direct": lambda s, k: RangeReader(direct=True, direct_min_bytes=0).read(s.local_path(k), 0, 4096),
    "ranges_readinto": lambda s, k: RangeReader().readinto(s.local_path(k), 0, [memoryview(bytearray(16))]),
}


@pytest.mark.parametrize("method", sorted(READS))
@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_reads_refuse_special_files(store: LocalStore, kind: str, method: str) -> None:
    p = Path(store.root) / "commits"
    p.mkdir()
    make_special(p / "3.json", kind)
    with pytest.raises(NotAFileError) as e:
        bounded(READS[method], store, "commits/3.json", fifo=p / "3.json")
    assert e.value.code == "not_a_file" and "3.json" in str(e.value)


_DEVICE_CASES = """
import json, os, resource, sys
from ucl.io.stores.local import LocalStore
from tests.io.stores.test_local_containment import READS
root = sys.argv[1]
# a runaway read fails with MemoryError instead of taking the machine's memory
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) << 10
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, fn in sorted(READS.items()):
    try:
        fn(LocalStore(root), "dev")
        out[name] = "returned"
    except BaseException as e:
        out[name] = getattr(e, "code", type(e).__name__)
out["rss_growth_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps(out))
"""


def test_reads_refuse_device_nodes(tmp_path: Path) -> None:
    """A /dev/zero-like node: every read path refuses it (not_a_file) with bounded memory, where reading it
    whole never ends. In a subprocess with an address-space limit, so a runaway read cannot hurt."""
    if (why := can_mknod(tmp_path)) is not None:
        pytest.skip(why)
    make_special(tmp_path / "dev", "chardev")
    import json

    r = subprocess.run([sys.executable, "-c", _DEVICE_CASES, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).parents[3])
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got.pop("rss_growth_kib") < 256 << 10
    assert got == {name: "not_a_file" for name in READS}


def test_size_and_exists_of_special_files(store: LocalStore) -> None:
    root = Path(store.root)
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "file").write_bytes(b"x")
    assert store.exists("fifo") and store.exists("dir")  # present (not absent), just not documents
    for key in ("fifo", "dir"):
        with pytest.raises(NotAFileError):
            store.size(key)
    assert store.size("file") == 1
    assert store.size("missing") is None and not store.exists("missing")
    assert store.size("file/below") is None and not store.exists("file/below")  # ENOTDIR: absent


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_list_dir_of_a_non_directory(store: LocalStore, kind: str) -> None:
    """A FIFO (or a file) where ``commits/`` should be is not an empty directory: it would hide every step
    (and gc would take every step for uncommitted)."""
    p = Path(store.root) / "commits"
    os.mkfifo(p) if kind == "fifo" else p.write_text("x")
    with pytest.raises(NotAFileError):
        store.list_dir("commits")
    assert store.list_dir("missing") == []


def test_read_bounded(store: LocalStore) -> None:
    (Path(store.root) / "doc").write_bytes(b"x" * 100)
    assert store.read_bounded("doc", 100) == b"x" * 100
    with pytest.raises(LimitExceededError):
        store.read_bounded("doc", 99)


def test_fifo_does_not_turn_o_direct_off(store: LocalStore) -> None:
    """O_DIRECT on a FIFO fails with EINVAL, as on a filesystem without O_DIRECT: the reader must not
    take a FIFO for such a filesystem."""
    root = Path(store.root)
    (root / "file").write_bytes(os.urandom(8192))
    rr = RangeReader(direct=True, direct_min_bytes=0)
    lease = rr.read(store.local_path("file"), 0, 8192)
    lease.release()
    if not rr.direct:
        pytest.skip("this filesystem has no O_DIRECT")
    os.mkfifo(root / "fifo")
    with pytest.raises(NotAFileError):
        bounded(rr.read, store.local_path("fifo"), 0, 8192, fifo=root / "fifo")
    assert rr.direct


def test_writes_to_a_fifo_do_not_block(store: LocalStore) -> None:
    root = Path(store.root)
    os.mkfifo(root / "fifo")
    with pytest.raises(WriteError):
        bounded(store.write, "fifo", [b"abc"])


# -- containment -----------------------------------------------------------------------------------
@pytest.fixture
def linked(tmp_path: Path) -> tuple[LocalStore, Path]:
    """A repository whose ``steps`` is a symlink to ``outside`` (holding a step 1 and a step 5 with a
    sentinel), and whose ``commits`` is a real directory."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    for d in ("1/a/c", "5"):
        (outside / d).mkdir(parents=True)
    (outside / "1" / "zarr.json").write_text("{}")
    (outside / "1" / "a" / "c" / "0").write_bytes(b"shard")
    (outside / "5" / "sentinel").write_text("keep me")
    (outside / "file.json").write_text("{}")
    repo.mkdir()
    (repo / "commits").mkdir()
    os.symlink(outside, repo / "steps")
    return LocalStore(str(repo)), outside


WRITES = {
    "write": lambda s: s.write("steps/5/a/c/0", [b"x"]),
    "write_atomic": lambda s: s.write_atomic("steps/5/zarr.json", b"{}"),
    "write_path": lambda s: s.write_path("steps/5/a/c/0"),
    "makedirs": lambda s: s.makedirs("steps/5/a/c"),
    "delete": lambda s: s.delete("steps/1/zarr.json"),
    "delete_prefix": lambda s: s.delete_prefix("steps/5"),
    "delete_prefix_child": lambda s: s.delete_prefix("steps/1/a"),
    "sync_dir": lambda s: s.sync_dir("steps/1"),
    "walk": lambda s: list(s.walk("steps")),
    "walk_child": lambda s: list(s.walk("steps/1")),
    "list_dir": lambda s: s.list_dir("steps"),
}


@pytest.mark.parametrize("method", sorted(WRITES))
def test_paths_through_a_symlinked_directory_are_refused(linked, method: str) -> None:
    store, outside = linked
    before = snapshot(outside)
    with pytest.raises(InvalidNameError) as e:
        WRITES[method](store)
    assert e.value.code == "invalid_name"
    assert snapshot(outside) == before


def test_a_symlinked_key_is_unlinked_never_followed(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    (outside / "d" / "x").write_text("keep")
    (outside / "f").write_text("keep")
    (repo / "steps").mkdir(parents=True)
    (repo / "commits").mkdir()
    os.symlink(outside / "d", repo / "steps" / "3")
    os.symlink(outside / "f", repo / "commits" / "3.json")
    store = LocalStore(str(repo))
    before = snapshot(outside)
    store.delete("commits/3.json")
    store.delete_prefix("steps/3")
    assert not os.path.lexists(repo / "commits" / "3.json") and not os.path.lexists(repo / "steps" / "3")
    assert snapshot(outside) == before


def test_writes_through_a_symlinked_key_are_refused(tmp_path: Path) -> None:
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("keep")
    (repo / "commits").mkdir(parents=True)
    os.symlink(outside / "f", repo / "commits" / "3.json")
    os.symlink(outside / "f", repo / "commits" / "4.json")
    store = LocalStore(str(repo))
    before = snapshot(outside)
    with pytest.raises(InvalidNameError):
        store.write("commits/3.json", [b"x"])
    with pytest.raises(InvalidNameError):
        store.write_atomic("commits/4.json", b"x")
    assert snapshot(outside) == before


def test_write_atomic_never_follows_a_planted_temporary(tmp_path: Path) -> None:
    """The temporary file's name is predictable (pid, thread): a symlink planted there is not followed."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_text("keep")
    (repo / "commits").mkdir(parents=True)
    os.symlink(outside / "f", repo / "commits" / f"3.json.tmp-{os.getpid()}-{threading.get_native_id()}")
    store = LocalStore(str(repo))
    before = snapshot(outside)
    with pytest.raises(UCLError):
        store.write_atomic("commits/3.json", b"x")
    assert snapshot(outside) == before


LOOPED = {
    "read": lambda s: s.read("commits/1.json"),
    "size": lambda s: s.size("commits/1.json"),
    "exists": lambda s: s.exists("commits/1.json"),
    "write": lambda s: s.write("commits/1.json", [b"x"]),
    "write_atomic": lambda s: s.write_atomic("commits/1.json", b"x"),
    "list_dir": lambda s: s.list_dir("commits"),
    "walk": lambda s: list(s.walk("commits")),
    "makedirs": lambda s: s.makedirs("commits/x"),
}


@pytest.mark.parametrize("op", sorted(LOOPED))
def test_symlink_loops_are_refused(store: LocalStore, op: str) -> None:
    os.symlink("commits", Path(store.root) / "commits")
    with pytest.raises(InvalidNameError):
        LOOPED[op](store)


def test_range_reader_paths_are_checked(linked) -> None:
    store, _ = linked
    with pytest.raises(InvalidNameError):
        store.local_path("steps/1/a/c/0")


def test_concurrent_atomic_writes_of_one_key(store: LocalStore) -> None:
    """Two threads of one process writing the same key atomically (two writers creating one repository)
    never take each other's temporary file."""
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(200):
                store.write_atomic("steps/zarr.json", b"%d-%d" % (n, i))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert sorted(os.listdir(Path(store.root) / "steps")) == ["zarr.json"]


# -- directories that cannot be made ---------------------------------------------------------------
@pytest.mark.parametrize("op", ["write", "write_atomic", "makedirs", "write_path"])
def test_a_file_where_a_directory_should_be_is_a_write_error(store: LocalStore, op: str) -> None:
    (Path(store.root) / "steps").write_text("not a directory")
    calls = {"write": lambda: store.write("steps/5/a/c/0", [b"x"]),
             "write_atomic": lambda: store.write_atomic("steps/5/zarr.json", b"x"),
             "makedirs": lambda: store.makedirs("steps/5/a"),
             "write_path": lambda: store.write_path("steps/5/a/c/0")}
    with pytest.raises(WriteError) as e:
        calls[op]()
    assert e.value.code == "write_failed" and "steps" in str(e.value)
    assert e.value.errno in (errno.ENOTDIR, errno.EEXIST)


@pytest.fixture
def tiny_fs(tmp_path: Path):
    """A tmpfs of 1 MiB and 16 inodes (needs root: mount(2))."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M,nr_inodes=16", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount is not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("op", ["write", "write_atomic", "write_path"])
def test_no_inodes_left_is_a_write_error(tiny_fs: Path, op: str) -> None:
    store = LocalStore(str(tiny_fs / "repo"))
    os.makedirs(store.root)
    calls = {"write": lambda k: store.write(f"{k}/x", [b"x"]),
             "write_atomic": lambda k: store.write_atomic(f"{k}/x", b"x"),
             "write_path": lambda k: store.write_path(f"{k}/x")}
    with pytest.raises(WriteError) as e:
        for i in range(64):  # 16 inodes: directories run out long before
            calls[op](f"steps/{i}/a")
    assert e.value.errno in (errno.ENOSPC, errno.EDQUOT)
    assert str(tiny_fs) in str(e.value)



def test_a_directory_read_through_before_does_not_let_a_symlink_in_it_out(tmp_path: Path) -> None:
    """Reads remember directories found to resolve inside the root (one lstat per path instead of a
    realpath): a symlink planted later in such a directory, to a file or a directory outside, is still
    refused, and a directory replaced by a symlink is refused as soon as it is forgotten (deleted)."""
    repo, outside = tmp_path / "repo", tmp_path / "outside"
    (repo / "steps" / "1" / "a").mkdir(parents=True)
    (repo / "steps" / "1" / "a" / "x").write_bytes(b"in")
    outside.mkdir()
    (outside / "secret").write_bytes(b"out")
    store = LocalStore(str(repo))
    assert store.read("steps/1/a/x") == b"in"
    assert store._dir_inside(str(repo / "steps" / "1" / "a"))  # remembered
    os.symlink(outside / "secret", repo / "steps" / "1" / "a" / "y")
    os.symlink(outside, repo / "steps" / "1" / "a" / "z")
    for key in ("steps/1/a/y", "steps/1/a/z/secret"):
        with pytest.raises(InvalidNameError):
            store.read(key)
    store.delete_prefix("steps/1/a")
    os.symlink(outside, repo / "steps" / "1" / "a")
    with pytest.raises(InvalidNameError):
        store.read("steps/1/a/secret")


def test_a_read_before_the_root_exists_does_not_stop_a_writer_making_it(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path / "new" / "repo"))
    with pytest.raises(FileNotFoundError):
        store.read("zarr.json")
    store.write_atomic("steps/1/zarr.json", b"{}")
    assert store.read("steps/1/zarr.json") == b"{}"
