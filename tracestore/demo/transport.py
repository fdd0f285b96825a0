"""Route the demo's records through the real system.

``RolloutRecorder`` → a ``tracestore serve`` subprocess (TCP on an ephemeral loopback port) →
``file://`` storage → ``GuidanceReader`` with a ``MicrobatchPlan``. One run per TRACE mode (its
recorded layers' MoE-input, K and V sites at its b), one trajectory per batch row.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from tracestore.demo.rollout import ForwardRecord, Rollout
from tracestore.demo.train import Mode, SiteGuidance
from tracestore.errors import ConfigError, StorageError

# site-name suffix -> record kind (MLA caches a latent and a rotary key instead of K and V)
KINDS = {"mlp.input": "moe_input", "attn.k": "key", "attn.v": "value", "attn.kv_latent": "other", "attn.k_rope": "key"}


def service_available() -> str | None:
    """None when the client SDK, the record model and the server are importable, else why not."""
    try:
        import tracestore.client as client
        import tracestore.plan  # noqa: F401
        import tracestore.records  # noqa: F401
        import tracestore.server.service  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or exc} is not importable"
    except Exception as exc:  # e.g. generated gRPC code refusing an older grpcio at import
        return f"the service does not import: {type(exc).__name__}: {exc}"
    missing = [n for n in ("RolloutRecorder", "GuidanceReader", "SiteOutput") if not hasattr(client, n)]
    return f"tracestore.client lacks {', '.join(missing)}" if missing else None


def run_id(mode: Mode) -> str:
    return "demo-" + mode.name.replace("_", "-")


def trajectory_id(b: int) -> str:
    return f"traj-{b}"


def _kind(site: str) -> str:
    return KINDS[site.split(".", 2)[2]]


class ServiceTransport:
    """A context manager that runs ``tracestore serve`` and records/reads the demo's runs through it.

    ``storage`` is a ``file://`` URL (default: ``<workdir>/store``); ``widths`` maps every site
    name to its width. Use :meth:`on_forward` as the rollout's callback, then :meth:`finish`, then
    :meth:`guidance` per mode.
    """

    def __init__(self, modes: tuple[Mode, ...], widths: dict[str, int], workdir: pathlib.Path, storage: str | None):
        from tracestore.records import RunSpec, SiteSpec

        self.workdir = workdir.resolve()  # the server runs with cwd=workdir: paths must be absolute
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.storage = storage or "file://" + str((workdir / "store").resolve())
        if not self.storage.startswith("file://"):
            raise ConfigError(f"--storage must be a file:// URL for the demo, got {self.storage!r}")
        self.modes = tuple(m for m in modes if m.quant == "trace")
        self.runs: dict[str, Any] = {}
        for m in self.modes:
            sites = tuple(
                SiteSpec(name, _kind(name), int(name.split(".")[1]), w, format="nvfp4", bits=m.bits)  # type: ignore[arg-type]
                for name, w in widths.items()
                if int(name.split(".")[1]) in m.layers
            )
            self.runs[m.name] = RunSpec(run_id(m), sites)
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
            sys.executable, "-m", "tracestore.cli", "serve",
            "--storage", self.storage, "--port", "0", "--metrics-port", "off",
            "--wal-dir", "off", "--flush-interval", "0.2",
            "--ready-file", str(ready), "--grace", "10",
        ]  # fmt: skip
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

    def on_forward(self, start: int, end: int, records: dict[str, ForwardRecord]) -> None:
        """Record one rollout forward (rows [B, end-start]) into every mode's run."""
        from tracestore.client.hf_hooks import site_outputs

        full = {name: (r.codes, r.scales, r.global_scale) for name, r in records.items()}
        for name, rec in self.recorders.items():
            outputs = site_outputs(full, self.runs[name])
            self.sent_bytes += sum(o.codes.numel() + o.scales.numel() for o in outputs.values())
            batch = next(iter(records.values())).codes.shape[0]
            rec.record_forward([(trajectory_id(i), start, end) for i in range(batch)], outputs)

    def finish(self, batch: int, n_tokens: int, timeout: float = 60.0) -> None:
        """Seal every trajectory and wait until everything sent is durable."""
        for name, rec in self.recorders.items():
            for i in range(batch):
                rec.finish(trajectory_id(i), n_tokens)
            if not rec.flush(timeout=timeout):
                tail = (self.workdir / "serve.log").read_text(errors="replace")[-1500:]
                raise StorageError(
                    f"run {run_id_of(self.runs[name])}: records were not durably acked in {timeout:.0f}s "
                    f"(recorder stats {_plain(rec.stats)}); serve.log tail:\n{tail}"
                )
            self.stats[name] = _plain(rec.stats)
            rec.close()

    def guidance(self, roll: Rollout, mode: Mode) -> dict[str, SiteGuidance]:
        """Read ``mode``'s run back through ``GuidanceReader`` for the plan of the training batch."""
        from tracestore.client import GuidanceReader
        from tracestore.plan import MicrobatchPlan

        b, n = roll.tokens.shape
        plan = MicrobatchPlan([(trajectory_id(i), 0, n) for i in range(b)])
        reader = GuidanceReader(self.storage, run_id(mode), device=str(roll.tokens.device), prefetch=False)
        try:
            got = reader.read(plan)
        finally:
            with contextlib.suppress(Exception):
                reader.close()
        out = {}
        for name, g in got.items():
            valid = g.valid if g.valid is not None else torch.ones(b * n, dtype=torch.bool, device=g.codes.device)
            gs = torch.as_tensor(g.global_scale, dtype=torch.float32, device=g.codes.device)
            gs = gs.expand(b * n) if gs.dim() == 0 else gs
            out[name] = SiteGuidance(
                packed=g.codes.reshape(b, n, -1),
                scales=g.scales.reshape(b, n, -1),
                g=gs.reshape(b, n).clone(),
                valid=valid.reshape(b, n).bool(),
                bits=int(g.bits),
            )
        return out

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


def run_id_of(spec: Any) -> str:
    return str(spec.run)


def _plain(stats: Any) -> Any:
    if isinstance(stats, dict):
        return {str(k): _plain(v) for k, v in stats.items()}
    if hasattr(stats, "__dataclass_fields__"):
        import dataclasses

        return _plain(dataclasses.asdict(stats))
    return stats if isinstance(stats, (int, float, str, bool, type(None))) else str(stats)


def default_workdir(out: pathlib.Path | None) -> pathlib.Path:
    return (out / "service") if out is not None else pathlib.Path(tempfile.mkdtemp(prefix="tracestore-demo-"))
