"""The sidecar's unix socket (``unix_socket``): claiming its path, its group and mode, binding it,
removing it at shutdown.

Claiming the path removes only a stale socket (:func:`claim_unix_socket`), never a regular file,
a directory, a symlink or a socket a live server answers on. The socket has its group and mode
(:func:`socket_access`: nothing for other users) before anyone can reach it: it is bound inside a
fresh private directory, given them there, and only then linked to its path
(:func:`bind_unix_socket`). At shutdown :func:`remove_unix_socket` removes the path only while it
still names the socket this sidecar bound.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable

from tracestore.server.config import ServerConfig

from tracestore.errors import ConfigError


def claim_unix_socket(path: str) -> None:
    """Remove a stale socket (one nobody listens on: left over from a crash); refuse one a live
    server still answers on, and anything at ``path`` that is not a socket (a regular file,
    directory or symlink there is never removed)."""
    import socket
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot check --unix-socket {path}: {exc.strerror}") from exc
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(
            f"--unix-socket {path} exists and is {file_kind(st.st_mode)}, not a socket; it is left alone: "
            "remove it or choose another path"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(5.0)  # a listener with a full backlog must not hang the start
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):  # still the socket checked above
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise ConfigError(f"cannot remove the stale unix socket {path}: {exc.strerror}") from exc
        return
    except OSError as exc:
        raise ConfigError(
            f"cannot tell whether a server listens on unix socket {path} ({exc.strerror}); remove it or choose "
            "another --unix-socket"
        ) from exc
    finally:
        probe.close()
    raise ConfigError(f"unix socket {path} is in use by a running server; choose another --unix-socket")


def socket_access(cfg: ServerConfig) -> tuple[int | None, int]:
    """The unix socket's group (None: the sidecar's own) and mode, from ``socket_group`` and
    ``socket_mode``. Other users (the mode's last digit) are never admitted: they would reach
    every run, and no shared-memory pool could be checked against them (server/rpc/shm.py)."""
    gid = None
    if cfg.socket_group is not None:
        name = str(cfg.socket_group)
        if name.isdigit():
            gid = int(name)
        else:
            import grp

            try:
                gid = grp.getgrnam(name).gr_gid
            except KeyError:
                raise ConfigError(f"socket_group {name!r} (--socket-group) is not a group on this host") from None
    mode = (0o660 if gid is not None else 0o600) if cfg.socket_mode is None else cfg.socket_mode
    if not isinstance(mode, int) or mode < 0 or mode & ~0o770:
        raise ConfigError(
            f"socket_mode (--socket-mode) must be at most 0770 (nothing for other users), got {mode!r}: admit "
            "local users through --socket-group"
        )
    return gid, mode


def bind_unix_socket(
    listen: Callable[[str], object], path: str, gid: int | None, mode: int, what: str = "--unix-socket"
) -> os.stat_result:
    """Listen on unix socket ``path`` with group ``gid`` and ``mode`` from the first moment anyone
    can reach it: ``listen(tmp)`` binds a socket at a path inside a fresh 0700 directory next to
    ``path`` (a gRPC server's ``add_insecure_port("unix:" + tmp)``, or a plain socket's ``bind``),
    which is given its group and mode there, then hard-linked to ``path`` (which never replaces
    anything that appeared there since :func:`claim_unix_socket`). Returns the socket's stat."""
    import tempfile

    parent = os.path.dirname(os.path.abspath(path))
    try:
        private = tempfile.mkdtemp(prefix=".ts-", dir=parent)
    except OSError as exc:
        raise ConfigError(f"cannot listen on unix socket {path}: {exc}") from exc
    tmp = os.path.join(private, "s")
    try:
        if len(os.fsencode(tmp)) > 107:  # sun_path holds 108 bytes with the NUL
            raise ConfigError(
                f"unix socket path {path} is too long: it is bound first as {tmp} ({len(os.fsencode(tmp))} bytes, "
                f"at most 107); choose a shorter {what}"
            )
        try:
            listen(tmp)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(f"cannot listen on unix socket {path}: {exc}") from exc
        try:
            if gid is not None:
                os.chown(tmp, -1, gid)
            os.chmod(tmp, mode)
        except OSError as exc:
            raise ConfigError(
                f"cannot give unix socket {path} group {gid} and mode {mode:04o} ({exc.strerror}): the sidecar's "
                "user must be a member of --socket-group"
            ) from exc
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ConfigError(f"{path} appeared while the sidecar bound it; choose another {what}") from None
        except OSError as exc:
            raise ConfigError(f"cannot listen on unix socket {path}: {exc.strerror}") from exc
        return os.lstat(path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with contextlib.suppress(OSError):
            os.rmdir(private)


def remove_unix_socket(path: str, socket_id: tuple[int, int]) -> None:
    """Remove the socket at ``path`` if it is still the one bound there (``(st_dev, st_ino)``), not
    whatever took the path since."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == socket_id:
            os.unlink(path)


def file_kind(mode: int) -> str:
    """An ``st_mode``'s file type in words, for error messages: "a directory", "a FIFO", ..."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return what
    return f"file type {stat.S_IFMT(mode):o}"
