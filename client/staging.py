"""The recorder's staging pool: a fixed ring of host memory the device-to-host copies land in.

On the same host the pool is a file in ``/dev/shm`` that the sidecar maps read-only, so gRPC
carries only offsets (reserve -> copy -> commit -> release when durable). With a CUDA device the
pool is registered once at start-up (``cudaHostRegister``) so copies into it are truly async; a
failure to pin is reported then, not mid-rollout (users.md #7). Fixed size, never grows: when it
is full the recorder refuses the forward (marks it unguided) instead of blocking the engine.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from tracestore.errors import ConfigError


class StagingPool:
    """A ring allocator over one mmap. ``reserve(n)`` -> offset or None; ``release(offset)``.

    ``shared=True`` backs it with ``{shm_dir}/tracestore-<uuid>`` (``.name`` tells the sidecar).
    Releases may come in any order; space is reclaimed in allocation order.
    """

    def __init__(self, nbytes: int, *, shared: bool = False, shm_dir: str = "/dev/shm", align: int = 64) -> None:
        if nbytes < 4096:
            raise ConfigError(f"staging pool must be at least 4096 bytes, got {nbytes}")
        self.capacity = int(nbytes)
        self.align = align
        self.name: str | None = None
        self.path: Path | None = None
        if shared:
            self.name = f"tracestore-{uuid.uuid4().hex}"
            self.path = Path(shm_dir) / self.name
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.capacity)
                self.mm = mmap.mmap(fd, self.capacity)
            finally:
                os.close(fd)
        else:
            self.mm = mmap.mmap(-1, self.capacity)
        # Touch every page now (start-up), not on the engine's first copies: first-touch page faults
        # halved the staging copy rate (0.95 vs ~2+ GB/s measured on the bench machine).
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
