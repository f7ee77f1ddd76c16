"""A tarball is read (and decompressed) in one pass, and a refusal leaves nothing behind.

The proof of "once": the archive is a FIFO fed by a thread. A pipe cannot be seeked or read
twice, so a second pass over the compressed bytes (``r:*`` seeks back to the start, and a gzip or
xz stream decompresses from the start again) fails; the pull succeeds only if one pass is enough.
"""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time

import pytest

from preheat.errors import FetchError
from preheat.store import collect_orphans, pull, verify_store
from tests._support.store_fixtures import files_of, tar_bytes


class Feeder(threading.Thread):
    """Writes ``data`` into the FIFO ``path`` once (``written``: what the pipe accepted); then, until
    ``release``, answers any reopening of the FIFO with an immediate end of file, so code that
    tries to read the archive again fails instead of waiting for a writer forever."""

    def __init__(self, path, data: bytes):
        super().__init__(daemon=True)
        self.path, self.data, self.written = path, data, 0
        self.done = threading.Event()

    def run(self) -> None:
        try:
            with open(self.path, "wb") as f:
                for i in range(0, len(self.data), 4096):
                    f.write(self.data[i:i + 4096])
                    f.flush()
                    self.written = i + len(self.data[i:i + 4096])
        except BrokenPipeError:  # the reader stopped after the end-of-archive blocks
            pass
        while not self.done.is_set():  # a second open by a reader gets EOF, never data
            try:
                os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: no reader has it open
                self.done.wait(0.005)

    def release(self) -> None:
        """Stop answering; drain the pipe if the code under test stopped reading with it open."""
        self.done.set()
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            while self.is_alive():
                try:
                    if not os.read(fd, 1 << 16):
                        self.join(0.01)
                except BlockingIOError:
                    self.join(0.01)
        finally:
            os.close(fd)


@pytest.mark.parametrize("mode, suffix", [("w:gz", "tar.gz"), ("w:xz", "tar.xz")], ids=["gzip", "xz"])
def test_a_compressed_tarball_is_read_once(root, model, tmp_path, mode, suffix):
    data = tar_bytes(model, mode=mode)
    fifo = tmp_path / f"model.{suffix}"
    os.mkfifo(fifo)
    feeder = Feeder(fifo, data)
    feeder.start()
    try:
        snap = pull(fifo, root=root, progress=False)
    finally:
        feeder.release()
    assert files_of(snap) == files_of(model)
    # all of it went into the pipe, once (the reader may stop before a compressor's last few bytes)
    assert len(data) - 4096 <= feeder.written <= len(data)
    assert verify_store(root) == []


def test_the_same_archive_from_a_plain_file_gives_the_same_snapshot(root, model, tmp_path):
    archive = tmp_path / "model.tar.bz2"
    archive.write_bytes(tar_bytes(model, mode="w:bz2"))
    snap = pull(archive, root=root, progress=False)
    assert files_of(snap) == files_of(model)


def _tar(members) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link is None:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = link
                tf.addfile(info)
    return buf.getvalue()


@pytest.mark.parametrize("members, why", [
    ([("m/w.bin", b"w" * 5000, None), ("m/x", b"", (tarfile.SYMTYPE, "nowhere"))], "does not point to a file"),
    ([("m/w.bin", b"w" * 5000, None), ("m/a", b"1", None), ("m/a/b", b"2", None)], "both a file and a folder"),
    ([("m/w.bin", b"w" * 5000, None), ("m/../../x", b"1", None)], "path traversal"),
], ids=["dangling-link", "file-and-folder", "late-traversal"])
def test_a_refusal_after_members_were_read_leaves_no_blob_and_no_snapshot(root, tmp_path, members, why):
    """Members read before a late refusal were only staged: ``blobs/`` and ``snapshots/`` stay empty."""
    archive = tmp_path / "late.tar.gz"
    archive.write_bytes(_tar(members))
    with pytest.raises(FetchError) as err:
        pull(archive, root=root, progress=False)
    assert why in str(err.value) and "\n" not in str(err.value)
    models = root / "models"
    assert os.listdir(models / "blobs") == [] and os.listdir(models / "snapshots") == []
    assert os.listdir(models / "refs") == []


def test_a_truncated_stream_is_one_line_error_and_leaves_nothing(root, model, tmp_path):
    data = tar_bytes(model, mode="w:xz")
    archive = tmp_path / "cut.tar.xz"
    archive.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(FetchError) as err:
        pull(archive, root=root, progress=False)
    assert "damaged tar archive" in str(err.value) and "\n" not in str(err.value)
    assert os.listdir(root / "models" / "blobs") == []


def test_a_killed_extraction_leaves_staging_that_collect_orphans_removes(root, model, tmp_path):
    pull(model, root=root, progress=False)
    blobs = root / "models" / "blobs"
    staging = blobs / ".tmp-tar-killed"  # what a process killed mid-extraction leaves
    staging.mkdir()
    (staging / "0").write_bytes(b"half a member")
    kept = set(os.listdir(blobs))
    assert collect_orphans(root, grace_s=3600) == []  # young: its writer may be at work
    assert collect_orphans(root, grace_s=3600, now=time.time() + 7200) == ["blobs/.tmp-tar-killed"]
    assert set(os.listdir(blobs)) == kept - {".tmp-tar-killed"}
    assert verify_store(root) == []
