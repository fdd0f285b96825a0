"""The recorder's settings as one frozen, validated value: :class:`RecorderConfig`."""

from __future__ import annotations

import dataclasses
from typing import Any

from tracestore.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RecorderConfig:
    """Everything about a :class:`~tracestore.client.RolloutRecorder` but where it records to
    (address, run, writer, policy version); checked on construction, so a config that exists is
    usable. ``RolloutRecorder.from_config(address, run_spec, writer, config)`` builds a recorder
    from one; the recorder's keyword arguments build one the same way.

    ``staging_bytes``: the staging pool (its shared-memory segment with ``shared_memory``, which
    defaults to whether ``address`` is a unix socket; in ``shm_dir``, group ``shm_group``);
    ``batch_bytes``: the size messages are cut at; ``linger_s``: how long decode steps may wait to
    be sent together; ``give_up_s``: how long the sidecar may be away before the recorder's
    queued trajectories go unguided; ``reconnect_backoff_s`` .. ``reconnect_cap_s``: the reconnect
    backoff; ``epoch``: the writer's epoch (None: the current time in ns); ``connect``: start the
    sender now; ``pin``: pin the staging pool (None: when torch is loaded); ``channel_credentials``
    and ``token``: how the channel authenticates (``tracestore.client.transport.channel``)."""

    staging_bytes: int = 256 << 20
    batch_bytes: int = 4 << 20
    shared_memory: bool | None = None
    shm_dir: str = "/dev/shm"
    shm_group: int | str | None = None
    give_up_s: float = 30.0
    reconnect_backoff_s: float = 0.05
    reconnect_cap_s: float = 10.0
    epoch: int | None = None
    connect: bool = True
    pin: bool | None = None
    linger_s: float = 4.0  # decode steps per chunk: sidecar CPU per GB 17.2 s at 1 s, 7.6 s at 4 s (24 ms steps)
    channel_credentials: Any = None
    token: str | None = None

    def __post_init__(self) -> None:
        for name in ("staging_bytes", "batch_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer (bytes), got {value!r}")
        for name in ("give_up_s", "reconnect_backoff_s", "reconnect_cap_s", "linger_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0 < self.reconnect_backoff_s <= self.reconnect_cap_s:
            raise ConfigError(
                f"need 0 < reconnect_backoff_s <= reconnect_cap_s, got {self.reconnect_backoff_s}, "
                f"{self.reconnect_cap_s}"
            )
        epoch = self.epoch
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0):
            raise ConfigError(f"epoch must be an integer >= 0 or None, got {epoch!r}")
