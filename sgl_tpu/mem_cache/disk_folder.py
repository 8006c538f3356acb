"""The disk tier's folder (`--hicache-storage-dir`): private to the server's user, with a secret
that signs every page file (disk_tier.py), shared by the servers of that user that name it.

    DIR/                                  owned by the server's user, not writable by group
    │                                     or others; made mode 0700
    │                                     (default: <tmp>/sgl-tpu-hicache-<uid>)
    ├── hicache.key                       32 random bytes, mode 0600: made once (O_EXCL) by the
    │                                     first server, read by every later one
    └── <fingerprint hex>/                one per model fingerprint, mode 0700
        ├── <chain hash hex>.kv           a page (disk_tier.py)
        └── <chain hash hex>.<pid>-<writer>.tmp   a write in flight

One secret per folder: a server that finds the secret file changed (the folder was removed and
made again, by this server or another) adopts the one there; one that finds it gone makes it again
with its own key (O_EXCL: whoever comes first, the others read it).

A folder owned by another user, writable by group or others, a symlink (the default folder), or a
secret file that is not a private regular file of the server's user is refused with
`StorageDirError`: whoever can write there could plant KV pages. The refusal is fatal at start-up
(the launcher checks before any process starts); an OSError (the folder cannot be made) is not:
the server then runs with the host tier alone.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SECRET_NAME = "hicache.key"
SECRET_BYTES = 32
DEFAULT_CAP_FRACTION = 0.25  # of the free space (plus the tier's own files) at start


class StorageDirError(Exception):
    """The disk tier's folder is not safe to use; the message names it and what is wrong."""


FileId = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns): a file made again differs


@dataclass(frozen=True)
class Secret:
    """A folder's secret and the identity of the file it was read from."""

    key: bytes
    file_id: FileId


def default_storage_dir() -> Path:
    """`sgl-tpu-hicache-<uid>` in the temporary folder: one per user."""
    return Path(tempfile.gettempdir()) / f"sgl-tpu-hicache-{_uid()}"


def storage_dir(directory: str | os.PathLike | None) -> Path:
    return default_storage_dir() if directory is None else Path(directory)


def open_storage_dir(directory: Path, is_default: bool = False) -> Secret:
    """Make `directory` (mode 0700) or check it, and return its secret (made if missing).
    StorageDirError if it is unsafe; OSError if it cannot be made or read."""
    if not directory.exists() and not directory.is_symlink():
        directory.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # another server made it first: checked below
            pass
    check_private_dir(directory, allow_symlink=not is_default)
    return _read_or_make_secret(directory)


def make_private_subdir(path: Path) -> None:
    """`path` (a folder in a checked one) made mode 0700, or checked if it exists."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_private_dir(path, allow_symlink=False)


def restore_storage_dir(directory: Path, key: bytes, is_default: bool) -> Secret:
    """Make `directory` again after it vanished under a running server, or check it after its
    secret changed; return the folder's secret: `key` if it had none, else the one there
    (another server made the folder again first)."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    check_private_dir(directory, allow_symlink=not is_default)
    return _read_or_make_secret(directory, key)


def secret_file_id(directory: Path) -> FileId | None:
    """The identity of `directory`'s secret file now, None if it has none."""
    try:
        st = os.lstat(directory / SECRET_NAME)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _file_id(st)


def check_private_dir(path: Path, allow_symlink: bool) -> None:
    st = os.stat(path) if allow_symlink else os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"
        raise StorageDirError(f"KV disk tier folder {path} is {kind}; remove it or pass "
                              f"--hicache-storage-dir")
    _check_owner(path, st, "folder")
    if st.st_mode & 0o022:
        raise StorageDirError(
            f"KV disk tier folder {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):o}): they could plant KV pages; run chmod go-w on it")


def _check_owner(path: Path, st: os.stat_result, what: str) -> None:
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        raise StorageDirError(
            f"KV disk tier {what} {path} is owned by {_user(st.st_uid)}, not by this server's "
            f"user {_user(uid)}: it could hold planted KV pages; pass a --hicache-storage-dir "
            f"of your own")


def _read_or_make_secret(directory: Path, key: bytes | None = None) -> Secret:
    """The secret of `directory`; if it has none, `key` (a fresh one if None) becomes it."""
    path = directory / SECRET_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_secret(path)
    key = secrets.token_bytes(SECRET_BYTES) if key is None else key
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
        file_id = _file_id(os.fstat(f.fileno()))
    fsync_dir(directory)
    return Secret(key, file_id)


def _read_secret(path: Path) -> Secret:
    deadline = time.monotonic() + 1.0
    while True:  # a server that made it a moment ago may still be writing its 32 bytes
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            if e.errno == getattr(os, "ELOOP", 40):
                raise StorageDirError(f"KV disk tier secret {path} is a symlink; remove it") \
                    from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise StorageDirError(f"KV disk tier secret {path} is not a regular file")
            _check_owner(path, st, "secret")
            if st.st_mode & 0o077:
                raise StorageDirError(
                    f"KV disk tier secret {path} is readable or writable by others (mode "
                    f"{stat.S_IMODE(st.st_mode):o}); remove it and the page files it signed, "
                    f"or run chmod 600 on it")
            key = f.read(SECRET_BYTES + 1)
        if len(key) == SECRET_BYTES:
            return Secret(key, _file_id(st))
        if time.monotonic() > deadline:
            raise StorageDirError(f"KV disk tier secret {path} holds {len(key)} bytes, not "
                                  f"{SECRET_BYTES}; remove it (and the page files it signed)")
        time.sleep(0.05)


def _file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def default_max_bytes(folder: Path, own_bytes: int) -> int:
    """The cap when none is given: a quarter of the free space of `folder`'s file system plus
    what this tier's files already take there (so a restart does not shrink it)."""
    st = os.statvfs(folder)
    return int(DEFAULT_CAP_FRACTION * (st.f_bavail * st.f_frsize + own_bytes))


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"
