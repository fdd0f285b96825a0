"""Route the demo's records through the real system.

The rollout's slabs → ``RolloutRecorder.record_slab`` → a ``tracestore serve`` subprocess (TCP on
an ephemeral loopback port) → ``file://`` storage → ``GuidanceReader`` with a ``MicrobatchPlan``.
One run per TRACE mode (its recorded layers' MoE-input, K and V sites at its b), one trajectory per
batch row.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from tracestore.demo.train import Mode
from tracestore.errors import StorageError


def service_available() -> str | None:
    """None when the client SDK, the record model and the server are importable, else why not."""
    try:
        import tracestore.client as client
        import tracestore.plan  # noqa: F401
        import tracestore.records  # noqa: F401
        import tracestore.server.rpc.service  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or exc} is not importable"
    except Exception as exc:  # e.g. generated gRPC code refusing an older grpcio at import
        return f"the service does not import: {type(exc).__name__}: {exc}"
    missing = [n for n in ("RolloutRecorder", "GuidanceReader", "GuidedFP4Hooks") if not hasattr(client, n)]
    return f"tracestore.client lacks {', '.join(missing)}" if missing else None


def run_id(mode: Mode) -> str:
    return "demo-" + mode.name.replace("_", "-")


def trajectory_id(b: int) -> str:
    return f"traj-{b}"


def run_specs(modes: tuple[Mode, ...], sites: tuple[Any, ...], fmt: str) -> dict[str, Any]:
    """{mode name: RunSpec} for the TRACE modes: the hooked sites of their layers at their b."""
    from tracestore.records import RunSpec

    return {
        m.name: RunSpec(run_id(m), tuple(s.spec(bits=m.bits, format=fmt) for s in sites if m.records(s.layer)))
        for m in modes
        if m.quant == "trace"
    }


class ServiceTransport:
    """A context manager that runs ``tracestore serve`` and records/reads the demo's runs through it.

    ``storage`` is a ``file://`` URL (default: ``<workdir>/store``); ``runs`` maps each TRACE mode
    to its RunSpec. Use :meth:`on_forward` as the rollout's callback, then :meth:`finish`, then
    :meth:`guidance` per mode.
    """

    def __init__(self, runs: Mapping[str, Any], workdir: pathlib.Path, storage: str | None) -> None:
        from tracestore.errors import ConfigError

        self.workdir = workdir.resolve()  # the server runs with cwd=workdir: paths must be absolute
        self.workdir.mkdir(parents=True, exist_ok=True)
        if storage is None:  # the demo's own store: a previous run's records would collide with this one's
            shutil.rmtree(self.workdir / "store", ignore_errors=True)
        self.storage = storage or "file://" + str((workdir / "store").resolve())
        if not self.storage.startswith("file://"):
            raise ConfigError(f"--storage must be a file:// URL for the demo, got {self.storage!r}")
        self.runs = dict(runs)
        self.proc: subprocess.Popen[bytes] | None = None
        self.recorders: dict[str, Any] = {}
        self.address = ""
        self.sent_bytes = 0
        self.stats: dict[str, Any] = {}

    def __enter__(self) -> ServiceTransport:
        from tracestore.client import RolloutRecorder

        ready = self.workdir / "serve-ready.json"
        ready.unlink(missing_ok=True)
        self.log = open(self.workdir / "serve.log", "wb")  # noqa: SIM115 - closed in __exit__
        cmd = [
            sys.executable,
            "-m",
            "tracestore.cli",
            "serve",
            "--storage",
            self.storage,
            "--port",
            "0",
            "--metrics-port",
            "off",
            "--wal-dir",
            "off",
            "--flush-interval",
            "0.2",
            "--ready-file",
            str(ready),
            "--grace",
            "10",
        ]
        # --wal-dir off: an ack then means "the shard is committed to storage", so the trainer's
        # direct storage reads right after flush() see every record (a WAL ack may precede the shard).
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._stop()
                tail = (self.workdir / "serve.log").read_text(errors="replace")[-2000:]
                raise StorageError(
                    f"`tracestore serve` did not become ready (log {self.workdir / 'serve.log'}):\n{tail}"
                )
            time.sleep(0.05)
        self.address = f"127.0.0.1:{json.loads(ready.read_text())['port']}"
        for name, spec in self.runs.items():
            self.recorders[name] = RolloutRecorder(self.address, spec, writer="demo-rollout", policy_version=0)
        return self

    def on_forward(self, start: int, end: int, slabs: Mapping[str, Any], rows: int, token_ids: Any = None) -> None:
        """Record one rollout forward (``rows`` = batch x (end - start), batch-major) into every
        run; ``token_ids`` [batch, end - start]: its input tokens, each chunk's token identity."""
        batch = rows // (end - start)
        segs = [(trajectory_id(i), start, end) for i in range(batch)]
        ids = None if token_ids is None else token_ids.reshape(-1)
        for name, rec in self.recorders.items():
            slab = slabs[name]
            if not rec.record_slab(segs, slab, n_rows=rows, token_ids=ids):
                raise StorageError(f"run {self.runs[name].run}: the recorder refused a forward ({_plain(rec.stats)})")
            self.sent_bytes += rows * sum(f.code_bytes + f.scale_bytes for f in slab.layout)

    def finish(self, batch: int, n_tokens: int, timeout: float = 60.0) -> None:
        """Seal every trajectory and wait until everything sent is durable."""
        for name, rec in self.recorders.items():
            for i in range(batch):
                rec.finish(trajectory_id(i), n_tokens)
            if not rec.flush(timeout=timeout):
                tail = (self.workdir / "serve.log").read_text(errors="replace")[-1500:]
                raise StorageError(
                    f"run {self.runs[name].run}: records were not durably acked in {timeout:.0f}s "
                    f"(recorder stats {_plain(rec.stats)}); serve.log tail:\n{tail}"
                )
            self.stats[name] = _plain(rec.stats)
            rec.close()

    def guidance(
        self, tokens_shape: tuple[int, int], mode: Mode, device: str, rule: str = "bracket", tokens: Any = None
    ) -> dict[str, Any]:
        """Read ``mode``'s run back through ``GuidanceReader`` for the training batch's plan
        (trajectory-major rows, as the hooks flatten [batch, tokens]); ``tokens`` [batch, n]: the
        training batch's token ids, against which every record's token identity is checked."""
        from tracestore.client import GuidanceReader
        from tracestore.plan import MicrobatchPlan

        b, n = tokens_shape
        plan = MicrobatchPlan([(trajectory_id(i), 0, n) for i in range(b)])
        ids = None if tokens is None else tokens.reshape(-1)
        with GuidanceReader(self.storage, run_id(mode), device=device, prefetch=False, rule=rule) as reader:
            return dict(reader.read(plan, token_ids=ids))

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __exit__(self, *exc: object) -> None:
        for rec in self.recorders.values():
            with contextlib.suppress(Exception):
                rec.close()
        self._stop()
        self.log.close()


def _plain(stats: Any) -> Any:
    if isinstance(stats, dict):
        return {str(k): _plain(v) for k, v in stats.items()}
    return stats if isinstance(stats, (int, float, str, bool, type(None))) else str(stats)


def default_workdir(out: pathlib.Path | None) -> pathlib.Path:
    return (out / "service") if out is not None else pathlib.Path(tempfile.mkdtemp(prefix="tracestore-demo-"))
