"""The recorder's staging pool: a fixed ring of host memory the device-to-host copies land in.

On the same host the pool is a file in ``/dev/shm`` that the sidecar maps read-only, so gRPC
carries only offsets (reserve -> copy -> commit -> release when durable). The file is 0600, or
0640 in a group (``group=``, ``TRACESTORE_SHM_GROUP``) when the sidecar runs as another user of
that group: the sidecar reads only pools that everyone its unix socket admits could read
(server/rpc/shm.py). With a CUDA device the
pool is registered once at start-up (``cudaHostRegister``) so copies into it are truly async; a
failure to pin is reported then, not mid-rollout (docs/integration.md, RolloutRecorder). Fixed size,
never grows: when it
is full the recorder refuses the forward (marks it unguided) instead of blocking the engine.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import stat
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from tracestore.client.transport import unix_socket_path

from tracestore.errors import ConfigError
from tracestore.settings import SHM_GROUP, read_env

log = logging.getLogger("tracestore.client")


POOL_PREFIX = "tracestore-pool-"
_POOL_FILE = re.compile(re.escape(POOL_PREFIX) + r"[0-9a-f]{32}")
GROUP_ENV = "TRACESTORE_SHM_GROUP"


def resolve_group(group: int | str) -> int:
    """A group name or gid (``"1234"`` or ``1234``) -> gid; ConfigError for an unknown name."""
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise ConfigError(f"staging pool group {group!r} is not a group on this host") from None


def sweep_stale_pools(shm_dir: str | os.PathLike[str]) -> int:
    """Remove the shared staging pools in ``shm_dir`` whose recorder is gone; return how many.

    A recorder holds a shared ``flock`` on its pool file for as long as its process lives (the
    kernel drops it when the process dies, SIGKILL included), so a pool whose exclusive lock can be
    taken has no owner: it was left by a recorder that crashed before ``close()``, and its RAM
    (``/dev/shm`` is memory) would stay allocated until reboot. flock works across containers that
    share the directory, where process ids do not. A sidecar that still maps such a pool keeps its
    pages until it unmaps them. Pools of older recorders (``tracestore-<hex>``, no lock) are
    left."""
    removed = 0
    try:
        names = [n for n in os.listdir(shm_dir) if _POOL_FILE.fullmatch(n)]
    except OSError:
        return 0
    for name in names:
        path = Path(shm_dir) / name
        try:
            # never follows a symlink, never waits on a FIFO someone put there under a pool's name
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone already, not ours to open, or a symlink
            continue
        st: os.stat_result | None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):  # anything else is no pool: left alone
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: a live recorder holds it
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):
            os.close(fd)
            continue
        try:
            if st.st_ino == os.lstat(path).st_ino:
                path.unlink()
                removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    if removed:
        log.warning("removed %d staging pool(s) of recorders that died without closing from %s", removed, shm_dir)
    return removed


class StagingPool:
    """A ring allocator over one mmap. ``reserve(n)`` -> offset or None; ``release(offset)``.

    ``shared=True`` backs it with ``{shm_dir}/tracestore-pool-<uuid>`` (``.name`` tells the
    sidecar), locked while this process lives; pools that dead recorders left there are removed
    first (:func:`sweep_stale_pools`). The file is mode 0600; with ``group`` (a name or gid;
    default ``$TRACESTORE_SHM_GROUP``) it is 0640 in that group, which this process must be a
    member of (ConfigError otherwise).
    Releases may come in any order; space is reclaimed in allocation order.
    """

    def __init__(
        self,
        nbytes: int,
        *,
        shared: bool = False,
        shm_dir: str = "/dev/shm",
        align: int = 64,
        group: int | str | None = None,
    ) -> None:
        if nbytes < 4096:
            raise ConfigError(f"staging pool must be at least 4096 bytes, got {nbytes}")
        self.capacity = int(nbytes)
        self.align = align
        self.name: str | None = None
        self.path: Path | None = None
        self._owner_fd = -1
        self.stale_removed = 0  # pools of dead recorders removed from shm_dir when this one was made
        if group is None:
            group = read_env(SHM_GROUP)
        self.group = None if group is None or not shared else resolve_group(group)
        if shared:
            self.stale_removed = sweep_stale_pools(shm_dir)
            self.name = f"{POOL_PREFIX}{uuid.uuid4().hex}"
            self.path = Path(shm_dir) / self.name
            # Made under a name no sweep matches, locked, then renamed: a sweep never sees it unlocked.
            tmp = Path(shm_dir) / f".{self.name}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                if self.group is not None:
                    try:
                        os.fchown(fd, -1, self.group)
                    except PermissionError:
                        raise ConfigError(
                            f"cannot give staging pool {tmp} group {self.group}: this process (uid {os.geteuid()}) "
                            "is not a member of it"
                        ) from None
                os.fchmod(fd, 0o600 if self.group is None else 0o640)  # exactly, whatever the umask
                fcntl.flock(fd, fcntl.LOCK_SH)  # held while this process lives: the pool is in use
                os.ftruncate(fd, self.capacity)
                self.mm = mmap.mmap(fd, self.capacity)
                os.rename(tmp, self.path)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
                raise
            self._owner_fd = fd
        else:
            self.mm = mmap.mmap(-1, self.capacity)
        # Touch every page now (start-up), not on the engine's first copies: first-touch page
        # faults halve the staging copy rate.
        self.view = memoryview(self.mm)
        step = 1 << 20
        zeros = bytes(step)
        for off in range(0, self.capacity, step):
            n = min(step, self.capacity - off)
            self.view[off : off + n] = zeros[:n]
        self._lock = threading.Lock()
        self._ring: deque[list[int]] = deque()  # [offset, size, released]
        self._live: dict[int, list[int]] = {}
        self._head = 0  # oldest live byte
        self._tail = 0  # next free byte
        self.in_use = 0
        self._pinned: Any = None

    def reserve(self, n: int) -> int | None:
        size = -(-max(n, 1) // self.align) * self.align
        with self._lock:
            if not self._ring:
                self._head = self._tail = 0
            if self._tail > self._head or not self._ring:  # live bytes in [head, tail): not wrapped
                if self._tail + size <= self.capacity:
                    off = self._tail
                elif size <= self._head:
                    if self._tail < self.capacity and self._ring:  # pad the unusable end
                        pad = [self._tail, self.capacity - self._tail, 1]
                        self._ring.append(pad)
                    off = 0
                else:
                    return None
            else:  # wrapped: live bytes in [head, capacity) and [0, tail)
                if self._tail + size > self._head:
                    return None
                off = self._tail
            entry = [off, size, 0]
            self._ring.append(entry)
            self._live[off] = entry
            self._tail = off + size
            self.in_use += size
            return off

    def release(self, offset: int) -> None:
        with self._lock:
            entry = self._live.pop(offset, None)
            if entry is None:
                return
            entry[2] = 1
            self.in_use -= entry[1]
            while self._ring and self._ring[0][2]:
                first = self._ring.popleft()
                self._head = first[0] + first[1]
                if self._head >= self.capacity:
                    self._head = 0
            if not self._ring:
                self._head = self._tail = 0

    def pin(self) -> bool:
        """Register the pool with CUDA (``cudaHostRegister``) when torch sees a GPU; True if pinned."""
        try:
            import torch
        except ImportError:
            return False
        if not torch.cuda.is_available() or self._pinned is not None:
            return self._pinned is not None
        t = torch.frombuffer(self.mm, dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
        if int(rc) != 0:
            raise ConfigError(f"cudaHostRegister of the {self.capacity}-byte staging pool failed (error {rc})")
        self._pinned = t
        return True

    def tensor(self) -> Any:
        """The pool as a torch uint8 tensor (shares memory)."""
        if self._pinned is not None:
            return self._pinned
        import torch

        return torch.frombuffer(self.mm, dtype=torch.uint8)

    def close(self) -> None:
        if self._pinned is not None:
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self._pinned.data_ptr())
            self._pinned = None
        self.view.release()
        with contextlib.suppress(BufferError):
            self.mm.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        if self._owner_fd >= 0:
            os.close(self._owner_fd)  # (drops the lock)
            self._owner_fd = -1


def socket_group(address: str) -> int | None:
    """The group of the sidecar's unix socket at ``address`` when the socket admits that group and
    this process is in it (then the sidecar reads only pools of that group, server/rpc/shm.py)."""
    path = unix_socket_path(address)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode) or not st.st_mode & stat.S_IWGRP:
        return None
    mine = st.st_gid == os.getegid() or st.st_gid in os.getgroups() or os.geteuid() == 0
    return st.st_gid if mine else None
