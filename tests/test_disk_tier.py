"""The KV disk tier's faults, one by one (mem_cache/disk_tier.py, disk_folder.py): the byte cap
and LRU eviction, a full disk and writes coming back, a folder of another user or open to
others, planted and truncated files, orphaned temporaries, fsync, and two servers sharing one
folder while one flushes. tests/test_kv_tiers.py runs them at random under a state machine."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sgl_tpu.mem_cache import disk_tier as disk_tier_module
from sgl_tpu.mem_cache.disk_folder import (
    SECRET_NAME,
    StorageDirError,
    default_max_bytes,
    default_storage_dir,
)
from sgl_tpu.mem_cache.disk_tier import DiskTier

FINGERPRINT = bytes(range(16))
PAGE_SIZE = 2
ROW_ELEMS = 8
FOREIGN_UID = 12345
FILE_BYTES = 56 + 4 * PAGE_SIZE + 2 * ROW_ELEMS + 32  # header, tokens, int16 row, mac
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                             reason="chown needs root")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(folder: Path, **kw) -> DiskTier:
    kw.setdefault("max_bytes", 1 << 30)
    return DiskTier(folder, FINGERPRINT, PAGE_SIZE, kw.pop("row_elems", ROW_ELEMS), np.int16,
                    **kw)


def page(i: int, row_elems: int = ROW_ELEMS) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Page number i: its hash, tokens and row."""
    return (i.to_bytes(16, "little"), np.array([i, i + 1], np.int32),
            np.full(row_elems, i, np.int16))


def put(tier: DiskTier, *numbers: int) -> None:
    for i in numbers:
        tier.write(*page(i, tier.row_elems))
    tier.flush()


def get(tier: DiskTier, i: int) -> np.ndarray | None:
    page_hash, tokens, _ = page(i)
    return tier.read(page_hash, tokens)


def files(tier: DiskTier) -> set[int]:
    return {int.from_bytes(bytes.fromhex(p.stem), "little") for p in tier.dir.glob("*.kv")}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---- the cap ---------------------------------------------------------------------------------
def test_the_cap_keeps_the_most_recently_used_pages(tmp_path):
    tier = make(tmp_path, max_bytes=3 * FILE_BYTES + 50)
    assert tier.file_bytes == FILE_BYTES and tier.max_pages == 3
    put(tier, 0, 1, 2)
    assert get(tier, 0) is not None  # 0 is now the most recent: 1 goes first
    put(tier, 3)
    assert files(tier) == {0, 2, 3} and tier.evicted_pages == 1
    put(tier, 4, 5, 6, 7)
    assert files(tier) == {5, 6, 7} and tier.used_bytes() == 3 * tier.file_bytes
    assert tier.stats()["evicted_pages"] == 5 and tier.check(scan=True) is None
    tier.close()


def test_a_restart_orders_pages_by_mtime_and_applies_a_smaller_cap(tmp_path):
    tier = make(tmp_path)
    put(tier, 0, 1, 2)
    tier.close()
    for age, i in enumerate((1, 2, 0)):  # 1 is the oldest, 0 the newest
        path = tier.dir / (page(i)[0].hex() + ".kv")
        os.utime(path, (1000 + age, 1000 + age))
    again = make(tmp_path, max_bytes=2 * tier.file_bytes)
    assert files(again) == {2, 0} and again.evicted_pages == 1
    again.close()


def test_the_default_cap_is_a_quarter_of_the_free_space(tmp_path):
    tier = make(tmp_path, max_bytes=0)
    st = os.statvfs(tier.dir)
    assert tier.max_bytes == pytest.approx(st.f_bavail * st.f_frsize / 4, rel=0.01)
    with_own = default_max_bytes(tier.dir, 2**40) - default_max_bytes(tier.dir, 0)
    assert with_own == pytest.approx(2**38, abs=2**30)  # its own files count as free
    tier.close()


# ---- a full disk -----------------------------------------------------------------------------
def _fail_writes(tier: DiskTier, monkeypatch, code: int = errno.ENOSPC) -> list[int]:
    """Make every page write fail with `code` until the returned list is cleared of its 1."""
    switch = [1]
    real = tier._write_file

    def write_file(*args):
        if switch:
            raise OSError(code, os.strerror(code))
        return real(*args)

    monkeypatch.setattr(tier, "_write_file", write_file)
    return switch


def test_a_failing_write_pauses_writing_until_the_back_off_ends(tmp_path, monkeypatch, caplog):
    clock = Clock()
    tier = make(tmp_path, clock=clock)
    switch = _fail_writes(tier, monkeypatch, errno.EIO)
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        put(tier, 0, 1, 2)
    assert not tier.writable and len(tier) == 0 and tier.dropped_pages == 3
    assert caplog.text.count("host tier only") == 1  # one warning, not one per page
    switch.clear()  # the disk works again, but the back-off (1 s) has not ended
    put(tier, 3)
    assert files(tier) == set()
    clock.now = 1.5
    put(tier, 4)
    assert tier.writable and files(tier) == {4}


def test_a_flush_turns_writing_back_on(tmp_path, monkeypatch):
    tier = make(tmp_path, clock=Clock())
    switch = _fail_writes(tier, monkeypatch)
    put(tier, 0)
    assert not tier.writable
    switch.clear()
    tier.clear()
    assert tier.writable
    put(tier, 1)
    assert files(tier) == {1}


def test_a_full_disk_evicts_old_pages_and_retries(tmp_path, monkeypatch):
    tier = make(tmp_path)
    put(tier, *range(16))
    calls = []
    real = tier._write_file

    def write_file(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(tier, "_write_file", write_file)
    put(tier, 16)
    assert tier.writable and tier.evicted_pages == 2  # an eighth of 16
    assert files(tier) == set(range(2, 17))


def _tiny_filesystem(path: Path, size: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")


def test_a_really_full_disk_keeps_the_tier_writing_by_evicting(tmp_path):
    """A 64 KiB tmpfs: ENOSPC from the kernel, not from a mock."""
    folder = tmp_path / "tiny"
    _tiny_filesystem(folder, "64k")
    clock = Clock()
    try:
        tier = make(folder, row_elems=4096, clock=clock)  # 8 KiB pages, a cap above the disk
        put(tier, *range(40))
        assert tier.writable and tier.evicted_pages > 0 and 39 in files(tier)
        assert tier.check(scan=True) is None
        tier.clear()
        ballast = folder / "ballast"  # another program fills the disk: nothing to evict
        with pytest.raises(OSError):
            with open(ballast, "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        put(tier, 100)
        assert not tier.writable and files(tier) == set()
        ballast.unlink()  # space freed; after the back-off the next page is written
        clock.now = 2.0
        put(tier, 101)
        assert tier.writable and files(tier) == {101}
        assert get(tier, 101) is not None
        tier.close()
    finally:
        subprocess.run(["umount", str(folder)], check=False)


# ---- the folder is private -------------------------------------------------------------------
def test_the_default_folder_is_per_user_and_private(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = default_storage_dir()
    assert folder == tmp_path / f"sgl-tpu-hicache-{os.geteuid()}"
    tier = make(folder, is_default_dir=True)
    assert folder.stat().st_mode & 0o777 == 0o700
    assert tier.dir.stat().st_mode & 0o777 == 0o700
    assert (folder / SECRET_NAME).stat().st_mode & 0o777 == 0o600
    put(tier, 0)
    assert next(tier.dir.glob("*.kv")).stat().st_mode & 0o777 == 0o600
    tier.close()


@as_root
@pytest.mark.parametrize("what", ["folder", "secret"])
def test_a_folder_or_secret_of_another_user_is_refused(tmp_path, what):
    folder = tmp_path / "kv"
    make(folder).close()
    os.chown(folder if what == "folder" else folder / SECRET_NAME, FOREIGN_UID, -1)
    with pytest.raises(StorageDirError, match=f"{folder}.* owned by uid {FOREIGN_UID}"):
        make(folder)


def test_a_folder_writable_by_others_or_a_symlinked_default_is_refused(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    folder.chmod(0o777)
    with pytest.raises(StorageDirError, match="writable by group or others"):
        make(folder)
    folder.chmod(0o700)
    link = tmp_path / "link"
    link.symlink_to(folder)
    with pytest.raises(StorageDirError, match="symlink"):
        make(link, is_default_dir=True)
    make(link).close()  # a folder the user named may be a symlink
    (folder / SECRET_NAME).chmod(0o644)
    with pytest.raises(StorageDirError, match="chmod 600"):
        make(folder)


@as_root
@pytest.mark.parametrize("named", [True, False])
def test_the_server_refuses_a_foreign_folder_at_start_with_one_line(tmp_path, named):
    """Fatal for a folder the user named and for the default one (another user made it
    first): running on without the tier would hide the attempt."""
    folder = tmp_path / ("kv" if named else f"sgl-tpu-hicache-{os.geteuid()}")
    folder.mkdir(mode=0o700)
    os.chown(folder, FOREIGN_UID, -1)
    done = subprocess.run(
        [sys.executable, "-m", "sgl_tpu.launch_server", "--enable-hierarchical-cache",
         "--hicache-storage-backend", "file",
         *(["--hicache-storage-dir", str(folder)] if named else [])],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(tmp_path)})
    assert done.returncode == 1
    assert f"error: KV disk tier folder {folder} is owned by uid {FOREIGN_UID}" in done.stderr
    assert "Traceback" not in done.stderr


# ---- bad files -------------------------------------------------------------------------------
def test_a_planted_page_without_the_secret_is_rejected_and_deleted(tmp_path, caplog):
    attacker = make(tmp_path / "attacker")
    page_hash, tokens, _ = page(7)
    attacker.write(page_hash, tokens, np.full(ROW_ELEMS, -1, np.int16))  # a forged row
    attacker.close()
    tier = make(tmp_path / "victim")
    name = page_hash.hex() + ".kv"
    shutil.copy(attacker.dir / name, tier.dir / name)
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        assert get(tier, 7) is None
    assert "mac does not match" in caplog.text
    assert tier.skipped_files == 1 and not (tier.dir / name).exists()
    put(tier, 7)  # the real page is written in its place
    np.testing.assert_array_equal(get(tier, 7), page(7)[2])
    tier.close()


def test_a_truncated_page_is_deleted_at_start(tmp_path):
    tier = make(tmp_path)
    put(tier, 0, 1)
    tier.close()
    path = tier.dir / (page(1)[0].hex() + ".kv")
    path.write_bytes(path.read_bytes()[:-5])  # a power loss without fsync
    again = make(tmp_path)
    assert files(again) == {0} and again.skipped_files == 1 and get(again, 1) is None
    again.close()


def test_orphaned_temporaries_are_removed_at_start_and_live_ones_kept(tmp_path):
    tier = make(tmp_path)
    name = page(0)[0].hex()
    dead = tier.dir / f"{name}.{dead_pid()}-0a0b0c0d.tmp"
    live = tier.dir / f"{name}.{os.getppid()}-0a0b0c0d.tmp"  # another live process's
    reused = tier.dir / f"{name}.{os.getpid()}-0a0b0c0d.tmp"  # this pid, no live writer of it
    mine = tier.dir / f"{name}.{os.getpid()}-{tier._writer}.tmp"  # a live tier's in flight
    for path in (dead, live, reused, mine):
        path.write_bytes(b"half a page")
    make(tmp_path).close()
    assert not dead.exists() and not reused.exists()
    assert live.exists() and mine.exists()
    tier.close()


def test_names_of_other_forms_in_the_folder_are_left_alone(tmp_path):
    tier = make(tmp_path)
    put(tier, 0)
    tier.close()
    name = page(0)[0].hex()
    others = ["x.tmp", ".tmp", "a.b.tmp", f"{name}.9999999999-0a0b0c0d.tmp",
              f"{name}.{dead_pid()}-nothex00.tmp", f"{name}.0-0a0b0c0d.tmp", "notes.txt",
              "x.kv", page(10)[0].hex().upper() + ".kv", f"{name[:-2]} 0.kv"]
    for other in others:
        (tier.dir / other).write_bytes(b"not ours")
    (tier.dir / "folder.tmp").mkdir()
    again = make(tmp_path)
    assert len(again) == 1 and again.skipped_files == 0
    assert all((tier.dir / other).exists() for other in [*others, "folder.tmp"])
    np.testing.assert_array_equal(get(again, 0), page(0)[2])
    again.clear()  # a flush deletes page files only
    assert all((tier.dir / other).exists() for other in others)
    again.close()


def test_files_removed_during_the_start_scan_are_skipped(tmp_path, monkeypatch):
    """Another server evicts pages while this one lists the folder at start."""
    tier = make(tmp_path)
    put(tier, 0, 1, 2, 3)
    tier.close()
    vanishing = {page(i)[0].hex() + ".kv" for i in (1, 2)}
    real_scandir = os.scandir

    def scandir(path):
        for entry in real_scandir(path):
            if entry.name in vanishing:
                os.unlink(entry.path)  # listed, then gone before its stat
            yield entry

    monkeypatch.setattr(os, "scandir", scandir)
    again = make(tmp_path)
    monkeypatch.undo()
    assert len(again) == 2 and again.skipped_files == 0 and files(again) == {0, 3}
    assert again.check(scan=True) is None
    np.testing.assert_array_equal(get(again, 3), page(3)[2])
    again.close()


def _read_in_time(tier: DiskTier, i: int) -> np.ndarray | None:
    """`get`, failing the test instead of hanging if the read blocks."""
    result: list[np.ndarray | None] = []
    reader = threading.Thread(target=lambda: result.append(get(tier, i)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert result, "the read blocked"
    return result[0]


def test_reads_never_follow_a_symlink_or_wait_on_a_fifo(tmp_path, caplog):
    tier = make(tmp_path / "kv")
    put(tier, 0, 1, 2)
    name = {i: tier.dir / (page(i)[0].hex() + ".kv") for i in range(4)}
    outside = tmp_path / "outside.kv"
    os.replace(name[0], outside)  # a valid page file, reached through a symlink
    name[0].symlink_to(outside)
    name[1].unlink()
    os.mkfifo(name[1], 0o600)  # a reader that opened it without O_NONBLOCK would wait
    name[2].write_bytes(name[2].read_bytes() + b"grown")
    name[3].mkdir()  # not in the index: planted under a name a request looks up
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        for i in range(4):
            assert _read_in_time(tier, i) is None
    assert "a symlink" in caplog.text and "not a regular file" in caplog.text
    assert "expected" in caplog.text
    assert len(tier) == 0 and tier.skipped_files == 4  # each dropped from the index
    assert not any(os.path.lexists(name[i]) for i in range(3)) and outside.exists()
    put(tier, 0, 1)  # the pages are written again in their place
    np.testing.assert_array_equal(_read_in_time(tier, 1), page(1)[2])
    assert tier.check(scan=True) is None
    tier.close()


@pytest.mark.parametrize("durability", ["none", "fsync"])
def test_fsync_durability_syncs_the_file_and_the_folder(tmp_path, monkeypatch, durability):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    tier = make(tmp_path, durability=durability)
    synced.clear()  # (the secret is synced once when made)
    put(tier, 0, 1)
    assert len(synced) == (4 if durability == "fsync" else 0)
    assert tier.stats()["durability"] == durability
    tier.close()


# ---- two servers on one folder ---------------------------------------------------------------
def test_a_flush_on_one_server_leaves_the_other_storing_and_serving(tmp_path, caplog):
    a, b = make(tmp_path), make(tmp_path)
    put(a, 0, 1)
    put(b, 2, 3)
    np.testing.assert_array_equal(get(b, 0), page(0)[2])  # written by the other server
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        a.clear()
        assert files(a) == set() and (tmp_path / SECRET_NAME).exists() and a.dir.is_dir()
        assert get(b, 2) is None and get(b, 3) is None  # removed under it: a plain miss
        put(b, 4)
    assert caplog.text == "" and b.writable and b.skipped_files == 0
    np.testing.assert_array_equal(get(a, 4), page(4)[2])
    shutil.rmtree(tmp_path)  # the whole folder vanishes: the next write makes it again
    put(b, 5)
    assert b.writable and (tmp_path / SECRET_NAME).stat().st_mode & 0o777 == 0o600
    np.testing.assert_array_equal(get(a, 5), page(5)[2])  # signed with the same secret
    assert a.check() is None and b.check() is None
    a.close()
    b.close()


def test_a_queue_past_its_bound_drops_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier_module, "_MAX_QUEUED_BYTES", 3 * 2 * ROW_ELEMS)
    tier = make(tmp_path)
    gate = threading.Event()
    real = tier._write_file
    monkeypatch.setattr(tier, "_write_file", lambda *a: (gate.wait(), real(*a)))
    for i in range(5):
        tier.write(*page(i))
    assert tier.queued() == 3 and tier.dropped_pages == 2
    gate.set()
    tier.flush()
    assert files(tier) == {0, 1, 2}
    tier.close()


def test_a_folder_made_again_keeps_one_secret_for_every_server(tmp_path, caplog):
    """Servers on a folder that is removed and made again by another server (with a secret of
    its own) adopt the new secret: none deletes the others' pages as planted."""
    folder = tmp_path / "kv"
    a, b = make(folder), make(folder)
    put(a, 0)
    first_secret = (folder / SECRET_NAME).read_bytes()
    shutil.rmtree(folder)
    c = make(folder)  # a new server: the folder and a new secret
    assert (folder / SECRET_NAME).read_bytes() != first_secret
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        put(a, 1)  # the writer sees the secret file changed and adopts it
        np.testing.assert_array_equal(get(c, 1), page(1)[2])
        put(c, 2)
        np.testing.assert_array_equal(get(b, 2), page(2)[2])  # a mac mismatch re-reads it
        np.testing.assert_array_equal(get(a, 2), page(2)[2])
        shutil.rmtree(folder)
        put(b, 3)  # this time a running server makes it again first, with its own secret
        d = make(folder)
        np.testing.assert_array_equal(get(d, 3), page(3)[2])
        put(d, 4)
        np.testing.assert_array_equal(get(c, 4), page(4)[2])
    assert "skipping" not in caplog.text
    assert {t.skipped_files for t in (a, b, c, d)} == {0}
    assert files(d) == {3, 4}
    for tier in (a, b, c, d):
        tier.close()


def test_secret_made_by_a_racing_server_is_read_once_complete(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    secret = folder / SECRET_NAME
    fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"x" * 10)  # the other server has written a third of it so far

    def finish():
        time.sleep(0.2)
        os.write(fd, b"x" * 22)
        os.close(fd)

    threading.Thread(target=finish).start()
    tier = make(folder)
    assert tier._secret.key == b"x" * 32
    tier.close()


def test_disk_tier_flags_are_checked():
    from sgl_tpu.config import ServerArgs

    base = {"enable_hierarchical_cache": True, "hicache_storage_backend": "file"}
    assert ServerArgs(**base, hicache_storage_max_bytes=2**30,
                      hicache_storage_durability="fsync").hicache_storage_max_bytes == 2**30
    with pytest.raises(ValueError, match="hicache_storage_max_bytes"):
        ServerArgs(**base, hicache_storage_max_bytes=-1)
    with pytest.raises(ValueError, match="hicache_storage_durability"):
        ServerArgs(**base, hicache_storage_durability="sometimes")


@as_root
def test_a_folder_replaced_by_another_users_pauses_writing(tmp_path, caplog):
    folder = tmp_path / "kv"
    tier = make(folder)
    shutil.rmtree(folder)
    folder.mkdir(mode=0o700)
    os.chown(folder, FOREIGN_UID, -1)  # someone else made it again, and nothing is written there
    with caplog.at_level(logging.WARNING, logger="sgl_tpu.mem_cache.disk_tier"):
        put(tier, 0)  # (returns: the writer lives on)
    assert not tier.writable and f"owned by uid {FOREIGN_UID}" in caplog.text
    assert list(folder.iterdir()) == []
    tier.close()
