"""The writers' shared-memory staging pools, mapped read-only by the sidecar.

A client on the unix socket names its pool (``WriteRequest.shm_pool``) and sends offsets into it;
the sidecar maps the file and reads the records from there. The name comes from the client, so
every pool is checked before it is mapped: the sidecar must never read a file for a client that
the client could not read itself, and opening it must never block.

Who may be a pool's owner. gRPC does not tell a server which user is on the other end of a unix
socket: ``context.peer()`` is ``"unix:"`` for every such client and ``auth_context()`` carries no
credentials (gRPC core does not expose ``SO_PEERCRED``, insecure or local credentials alike), and
the accepted socket is never handed to Python. So the check is not "owned by the connecting uid"
but "readable by everyone who can connect", which the sidecar does know, from the socket's mode:

- the socket admits only its owner (mode 0600, the default without a group): a pool must be owned
  by the sidecar's own uid. Anyone who can connect runs as that uid (or as root) and could read
  the pool directly.
- the socket admits a group (group write on it, ``socket_group``): a pool must belong to that
  group and be group-readable (0640). A file can only get a group its owner is a member of
  (chgrp, or creation), unless root did it, so such a pool was put there by a member of the
  group — and every client that can connect is a member, the sidecar's uid or root, all of whom
  can read it without the sidecar.

Besides: the name must match :data:`POOL_NAME` (no slash, no ``..``) and the file lie directly in
``shm_dir``; it is opened ``O_NOFOLLOW | O_NONBLOCK`` (a symlink is refused, a FIFO does not block)
and checked on the open descriptor (``fstat``, so it cannot be swapped after the check): a
regular file with a single link (a hard link of another file would carry that file's owner and
mode), no world bits, no group write, no set-id bits, and a size in [4096, ``max_pool_bytes``].

The trade-off of not knowing the peer: a member of the socket's group can name another member's pool
and have its staged bytes stored under its own writer id. It gains nothing it could not read itself
(the pool is group-readable, and the ``Read`` RPC serves every run it may read), so pools are not
tied to the caller's uid even when the token file authorizes unix peers by uid
(``server/security/peer_auth.py``): what the caller may write is checked by its identity's scopes,
not by whose pool the bytes came from. A pool carrying a POSIX ACL is refused: its group mode bits
are then the ACL's mask, which says nothing about which group members may read it.

Truncation. A pool's owner can truncate it under a mapping; reading the mapping past the new end
raises SIGBUS, which kills the sidecar (in C code: not an exception Python could catch). A pool
owned by the sidecar's own uid is mapped and read in place (zero copy): its owner could kill the
sidecar anyway. A pool of any other owner (a group member's, see above, and root's too: a root
engine in another container could not otherwise kill a non-root sidecar) is never mapped:
:meth:`ShmPools.view` copies the referenced bytes out with ``pread`` on the checked
descriptor, and a short read (the pool shrank) is an INVALID_ARGUMENT naming the pool, so no
other user can take the sidecar down. The copy is the one ``Message.own_shm`` would make anyway
for a writer that does not keep its staging; a writer that does pays one memcpy per payload byte.
(A sealed memfd passed over the socket would allow zero copy here too, but gRPC cannot carry
descriptors.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from tracestore.server.config import SHM_POOLS, ServerConfig
from tracestore.server.security.unix_socket import file_kind

from tracestore.errors import LimitError, PermissionDeniedError, ValidationError

POOL_NAME = re.compile(r"tracestore-[A-Za-z0-9_-][A-Za-z0-9_.-]{0,99}")
MIN_POOL_BYTES = 4096
_FORBIDDEN_MODE = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IRWXO


class ShmPools:
    """Writers' staging pools (files directly in ``shm_dir``), checked and opened on first use.

    ``group``: the gid every pool must belong to (group-readable), when the sidecar's unix socket
    admits that group; None: the socket admits only the sidecar's uid, and pools must be owned by
    it (see the module docstring). Refusals raise :class:`ValidationError` (INVALID_ARGUMENT: not
    a pool at all) or :class:`PermissionDeniedError` (PERMISSION_DENIED: a pool the client may not
    have read), naming the pool and what was expected.

    At most :attr:`MAX_POOLS` pools are open at once, and a pool stays open while its file exists.
    ``share`` (authentication on): how many of them one identity may have opened (the identity that
    first named a pool holds its slot until the pool is closed), so that a caller naming pool files
    of its own cannot take every slot from the others. Either limit refuses a new pool with
    :class:`LimitError` (RESOURCE_EXHAUSTED: a slot comes back when a recorder closes and removes
    its pool file).
    """

    MAX_POOLS = SHM_POOLS
    MAX_POOL_BYTES = 64 << 30

    def __init__(
        self,
        shm_dir: str,
        on_change: Callable[[int], None] | None = None,
        *,
        group: int | None = None,
        max_pool_bytes: int | None = None,
        share: int | None = None,
    ) -> None:
        self.dir = Path(shm_dir)
        self.group = group
        self.uid = os.geteuid()
        self.max_pool_bytes = self.MAX_POOL_BYTES if max_pool_bytes is None else int(max_pool_bytes)
        self.share = share
        self._maps: dict[str, mmap.mmap] = {}  # pools read in place
        self._copied: dict[str, tuple[int, int]] = {}  # pools read with pread: name -> (fd, size)
        self._opened_by: dict[str, str] = {}  # pool -> the identity whose share it counts in
        self.held: dict[str, int] = {}  # identity -> pools it holds open (an entry only while > 0)
        self._lock = threading.Lock()
        self._on_change = on_change

    @classmethod
    def for_config(cls, cfg: ServerConfig, on_change: Callable[[int], None] | None = None) -> ShmPools:
        """The pools of a sidecar configured by ``cfg``: its directory and largest pool, and with a
        token file the share of one identity (``shm_pools_per_identity``)."""
        share = cfg.shm_pools_per_identity if cfg.auth_tokens is not None else None
        return cls(cfg.shm_dir, on_change, max_pool_bytes=cfg.max_shm_pool_bytes, share=share)

    def viewer(self, identity: str | None) -> Callable[[str, int, int], memoryview]:
        """:meth:`view` on behalf of the caller ``identity`` (None: counted in no share)."""
        return lambda name, offset, length: self.view(name, offset, length, identity)

    def _forget_gone(self) -> None:
        # A recorder unlinks its pool when it closes; drop our map of it so its memory is freed.
        for name in [n for n in self._maps if not os.path.lexists(self.dir / n)]:
            with contextlib.suppress(BufferError):
                self._maps.pop(name).close()
            self._give_back(name)
        for name in [n for n in self._copied if not os.path.lexists(self.dir / n)]:
            os.close(self._copied.pop(name)[0])
            self._give_back(name)

    def _give_back(self, name: str) -> None:
        """Pool ``name`` is closed: its slot goes back to the identity that held it (lock held)."""
        who = self._opened_by.pop(name, None)
        if who is not None:
            left = self.held[who] - 1
            if left:
                self.held[who] = left
            else:
                del self.held[who]

    def _check_slot(self, identity: str | None) -> None:
        """LimitError unless ``identity`` may open one more pool: its share first (a caller over its
        own share is told so), then the sidecar's limit. Under the lock."""
        if identity is not None and self.share is not None and self.held.get(identity, 0) >= self.share:
            raise LimitError(
                f"caller {identity!r} holds {self.share} shared-memory pools open on this sidecar, its share "
                "(max_shm_pools_per_identity, --max-shm-pools-per-identity); a slot comes back when one of its "
                "recorders closes (its pool file removed): retry later, or raise the share"
            )
        if len(self._maps) + len(self._copied) >= self.MAX_POOLS:
            raise LimitError(
                f"{self.MAX_POOLS} shared-memory pools are open on this sidecar, its limit; a slot comes back when a "
                "recorder closes (its pool file removed): retry later, or close idle recorders"
            )

    def view(self, name: str, offset: int, length: int, identity: str | None = None) -> memoryview:
        """``length`` bytes at ``offset`` of pool ``name``, which is checked and opened on first
        use: a pool opened for ``identity`` counts in its share (:meth:`viewer`)."""
        mm = self._maps.get(name)  # (three lookups per chunk: the name was checked when it was mapped)
        if mm is not None and offset >= 0 and length >= 0 and offset + length <= len(mm):
            return memoryview(mm)[offset : offset + length]
        if POOL_NAME.fullmatch(name) is None or ".." in name:
            raise ValidationError(
                f"shared-memory pool name must match {POOL_NAME.pattern} (no '/', no '..'), got {name[:120]!r}"
            )
        with self._lock:
            mm = self._maps.get(name)
            copied = self._copied.get(name)
            if mm is None and copied is None:
                self._forget_gone()
                self._check_slot(identity)
                opened = self._open(name)
                if isinstance(opened, mmap.mmap):
                    mm = self._maps[name] = opened
                else:
                    copied = self._copied[name] = opened
                if identity is not None and self.share is not None:
                    self._opened_by[name] = identity
                    self.held[identity] = self.held.get(identity, 0) + 1
                if self._on_change is not None:
                    self._on_change(self._bytes())
            size = len(mm) if mm is not None else copied[1]  # type: ignore[index]
            if offset < 0 or length < 0 or offset + length > size:
                raise ValidationError(
                    f"shared-memory reference [{offset}, {offset + length}) lies outside pool {name!r} of {size} bytes"
                )
            if mm is not None:
                return memoryview(mm)[offset : offset + length]
            # A descriptor of our own for the copy: once the lock is released another stream may
            # close the pool's (_forget_gone, the pool unlinked), and the next open() in this
            # process would reuse its number, so a pread on it could read that other file.
            fd = os.dup(copied[0])  # type: ignore[index]
        try:
            return self._pread(name, fd, offset, length)
        finally:
            os.close(fd)

    def _pread(self, name: str, fd: int, offset: int, length: int) -> memoryview:
        buf = bytearray(length)
        got = 0
        while got < length:
            try:
                n = os.preadv(fd, [memoryview(buf)[got:]], offset + got)
            except OSError as exc:
                raise ValidationError(f"shared-memory pool {name!r} cannot be read: {exc.strerror}") from exc
            if n == 0:
                raise ValidationError(
                    f"shared-memory pool {name!r} ends at byte {offset + got}, inside the reference [{offset}, "
                    f"{offset + length}): its owner truncated it; expected the pool's size not to change while "
                    "its recorder lives"
                )
            got += n
        return memoryview(buf)

    def _bytes(self) -> int:
        return sum(len(m) for m in self._maps.values()) + sum(size for _, size in self._copied.values())

    def _open(self, name: str) -> mmap.mmap | tuple[int, int]:
        """The pool checked and opened: a read-only map when its owner is the sidecar's uid or
        root, else ``(descriptor, size)`` for copies with ``pread`` (see the module docstring)."""
        path = self.dir / name
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise ValidationError(
                f"shared-memory pool {name!r} cannot be opened in {self.dir} (expected a regular file there, "
                f"not a symlink): {exc.strerror}"
            ) from exc
        keep = False
        try:
            st = os.fstat(fd)
            self._check(name, st)
            _check_no_acl(name, self.dir, fd)
            if st.st_uid != self.uid:
                keep = True
                return fd, st.st_size
            try:
                # Populate the whole mapping now (once per recorder pool), not page by page on
                # the ingest path (a 4 MiB message: ~4.8 ms of faults)
                return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
            except (OSError, ValueError) as exc:
                raise ValidationError(f"shared-memory pool {name!r} cannot be mapped: {exc}") from exc
        finally:
            if not keep:
                os.close(fd)

    def _check(self, name: str, st: os.stat_result) -> None:
        where = f"shared-memory pool {name!r} in {self.dir}"
        if not stat.S_ISREG(st.st_mode):
            raise ValidationError(f"{where} must be a regular file, got {file_kind(st.st_mode)}")
        if st.st_nlink != 1:
            raise PermissionDeniedError(f"{where} must have exactly one link, has {st.st_nlink} (a hard link?)")
        mode = stat.S_IMODE(st.st_mode)
        if mode & _FORBIDDEN_MODE:
            raise PermissionDeniedError(
                f"{where} has mode {mode:04o}: expected no world bits, no group write and no set-id bits "
                f"(0600, or 0640 for a group)"
            )
        if self.group is None:
            if st.st_uid != self.uid:
                raise PermissionDeniedError(
                    f"{where} is owned by uid {st.st_uid}: expected the sidecar's uid {self.uid} (its unix socket "
                    f"admits no group; to accept other users' pools, serve with --socket-group)"
                )
        elif st.st_gid != self.group or not mode & stat.S_IRGRP:
            raise PermissionDeniedError(
                f"{where} has group {st.st_gid} and mode {mode:04o}: expected group {self.group}, group-readable "
                f"(0640), the group the sidecar's unix socket admits (RolloutRecorder(shm_group=...) or "
                f"TRACESTORE_SHM_GROUP)"
            )
        if not MIN_POOL_BYTES <= st.st_size <= self.max_pool_bytes:
            raise ValidationError(
                f"{where} is {st.st_size} bytes: expected {MIN_POOL_BYTES} to {self.max_pool_bytes} bytes"
            )

    def copies(self, name: str) -> bool:
        """Pool ``name`` is open and read with copies (another user's), not mapped in place."""
        with self._lock:
            return name in self._copied

    def capacity(self, name: str) -> int:
        """Bytes of pool ``name`` as mapped (0 if it is not mapped)."""
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                return len(mm)
            copied = self._copied.get(name)
            return 0 if copied is None else copied[1]

    def close(self) -> None:
        with self._lock:
            for mm in self._maps.values():
                with contextlib.suppress(BufferError):  # a view is still alive; it goes with the process
                    mm.close()
            self._maps.clear()
            for fd, _ in self._copied.values():
                os.close(fd)
            self._copied.clear()
            self._opened_by.clear()
            self.held.clear()


def _check_no_acl(name: str, where: Path, fd: int) -> None:
    """Refuse a pool that carries a POSIX access ACL: its group bits in ``st_mode`` are then the
    ACL's mask, not what the group may read (an ACL can grant the sidecar's uid alone), so the mode
    check would not show who else could read it."""
    try:
        names = os.listxattr(fd)
    except OSError:  # no extended attributes on this file system: no ACLs either
        return
    if "system.posix_acl_access" in names:
        raise PermissionDeniedError(
            f"shared-memory pool {name!r} in {where} carries a POSIX ACL: expected plain mode bits (0600, or 0640 "
            "for a group), so that who may read it is what its mode says"
        )


__all__ = ["MIN_POOL_BYTES", "POOL_NAME", "ShmPools"]
