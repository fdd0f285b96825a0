"""An example engine entrypoint that records: a transformers model generating continuously, FP4 at
every hooked site, every forward recorded through the tracestore sidecar beside it.

Stock vLLM/SGLang images never call the recorder, so a pod with only them and the sidecar records
nothing; this is the smallest engine that does (deploy/k8s/overlays/example-recording runs it). A
real engine makes the same calls from its own decode loop (docs/integration.md).

Loop: random prompts → ``model.generate()`` inside ``FP4SiteRecorder.forward`` (prefill and every
decode step quantized and recorded) → ``RolloutRecorder.finish`` seals each trajectory. SIGTERM
(or SIGINT) ends the loop after the rollout in flight; the recorder then flushes (waits until the
sidecar has made everything durable), closes, and the process exits 0 (1 if the recorder stopped
with an error, 2 for a bad setting). One JSON line on stdout summarises the run.

Settings (environment):

- ``TRACESTORE_ADDRESS`` (required): the sidecar, e.g. ``unix:///var/run/tracestore/tracestore.sock``.
- ``ENGINE_MODEL``: a transformers model name or local path (``AutoModelForCausalLM``; the weights
  must be reachable from the pod). Empty (default): a tiny randomly initialised ``qwen3_moe``.
- ``ENGINE_RUN`` (``example-run``), ``ENGINE_WRITER`` (default ``$HOSTNAME``-pid: unique per engine
  instance, the sidecar fences by it), ``ENGINE_FORMAT`` (``nvfp4`` or ``mxfp4``), ``ENGINE_BITS``
  (low bits recorded per value, 1), ``ENGINE_BATCH`` (2), ``ENGINE_PROMPT_LEN`` (8),
  ``ENGINE_NEW_TOKENS`` (8), ``ENGINE_MAX_ROLLOUTS`` (0: until SIGTERM), ``ENGINE_FLUSH_TIMEOUT``
  (seconds to wait for durability at exit, 40), ``ENGINE_SEED`` (0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any


def _env(name: str, default: str) -> str:
    return os.environ.get(name, "") or default


def _int(name: str, default: int, minimum: int = 0) -> int:
    raw = _env(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise SystemExit(f"record_engine: {name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SystemExit(f"record_engine: {name} must be >= {minimum}, got {value}")
    return value


def load_model(name: str, seed: int) -> Any:
    """``name`` through ``AutoModelForCausalLM.from_pretrained``, or the tiny random MoE when empty."""
    import torch

    if not name:
        from tracestore.demo.model import ModelSpec, build_model

        return build_model(
            ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, experts=4, expert_hidden=32, vocab=256), seed=seed
        )
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()


def main() -> int:
    address = os.environ.get("TRACESTORE_ADDRESS", "")
    if not address:
        print(
            "record_engine: TRACESTORE_ADDRESS is not set (e.g. unix:///var/run/tracestore/tracestore.sock)",
            file=sys.stderr,
        )
        return 2
    run = _env("ENGINE_RUN", "example-run")
    writer = _env("ENGINE_WRITER", f"{socket.gethostname()}-{os.getpid()}")
    fmt = _env("ENGINE_FORMAT", "nvfp4")
    bits = _int("ENGINE_BITS", 1, 1)
    batch = _int("ENGINE_BATCH", 2, 1)
    prompt_len = _int("ENGINE_PROMPT_LEN", 8, 1)
    new_tokens = _int("ENGINE_NEW_TOKENS", 8, 1)
    max_rollouts = _int("ENGINE_MAX_ROLLOUTS", 0)
    flush_timeout = float(_env("ENGINE_FLUSH_TIMEOUT", "40"))
    seed = _int("ENGINE_SEED", 0)

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    import torch
    from tracestore.client import RolloutRecorder
    from tracestore.client.hf.hooks import HFSiteHooks
    from tracestore.client.hf.recorder import FP4SiteRecorder

    from tracestore.records import RunSpec

    model = load_model(_env("ENGINE_MODEL", ""), seed)
    # The run declares every site the hooks find on this model (a real engine may pick a subset).
    with HFSiteHooks(model, lambda site, x: None) as probe:
        sites = tuple(s.spec(bits=bits, format=fmt) for s in probe.sites)
    spec = RunSpec(run, sites)
    vocab = int(model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    rec = RolloutRecorder(address, spec, writer=writer)
    started = time.monotonic()
    rollouts = sealed = 0
    try:
        with FP4SiteRecorder(model, [rec], fmt=fmt) as fp4, torch.no_grad():
            what = f"{len(sites)} sites, batch {batch}, {prompt_len}+{new_tokens} tokens per trajectory"
            print(f"record_engine: recording run {run!r} as writer {writer!r} to {address}: {what}", file=sys.stderr)
            while not stop.is_set() and rec.error is None and (max_rollouts == 0 or rollouts < max_rollouts):
                prompts = torch.randint(3, vocab, (batch, prompt_len), generator=gen)
                trajs = [f"{writer}-{rollouts:06d}-{b}" for b in range(batch)]
                with fp4.forward([(t, 0, None) for t in trajs]):
                    out = model.generate(
                        prompts,
                        attention_mask=torch.ones_like(prompts),
                        max_new_tokens=new_tokens,
                        min_new_tokens=new_tokens,
                        do_sample=True,
                        pad_token_id=model.config.get_text_config().pad_token_id,
                        **fp4.hooks.cache_kwargs(fp4.hooks.new_cache()),
                    )
                for t in trajs:  # positions 0..n-2 were recorded; the last sampled token never enters the model
                    sealed += bool(rec.finish(t, int(out.shape[1])))
                rollouts += 1
        durable = rec.flush(timeout=flush_timeout)
    finally:
        rec.close()
    summary = {
        "run": run,
        "writer": writer,
        "rollouts": rollouts,
        "trajectories_sealed": sealed,
        "unguided": len(rec.unguided),
        "durable": bool(durable),
        "error": None if rec.error is None else str(rec.error),
        "seconds": round(time.monotonic() - started, 2),
    }
    print(json.dumps(summary), flush=True)
    return 1 if rec.error is not None or not durable else 0


if __name__ == "__main__":
    sys.exit(main())
