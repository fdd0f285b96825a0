"""8. Hostile requests: a table of malformed, oversized and adversarial messages, each answered with
the documented status (docs/protocol.md, "Status codes": bad input INVALID_ARGUMENT, wrong order FAILED_PRECONDITION,
conflicting bytes ALREADY_EXISTS, over a limit RESOURCE_EXHAUSTED, corrupted DATA_LOSS, unknown run
NOT_FOUND); then a time-bounded fuzz (random mutations of valid messages on every RPC,
``TRACESTORE_FUZZ_S`` seconds, 20 by default) beside a good writer that loses nothing, the sidecar
SERVING throughout and nothing written outside its storage root.
"""

from __future__ import annotations

import os
import random
import struct
import time
from collections import Counter
from collections.abc import Callable

import grpc
import pytest

from tracestore.v1 import tracestore_pb2 as pb
from tracestore.wire import run_spec_to_pb

from .harness import (
    READ,
    SEAL,
    SPEC,
    STAT,
    WRITE,
    Background,
    MiB,
    Sidecar,
    Writer,
    converged,
    make_recs,
    row,
    verify,
    wait_until,
)

MAX_MESSAGE_MIB = 4


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    sc = Sidecar(
        tmp_path_factory.mktemp("hostile"),
        flags=["--max-message-mib", str(MAX_MESSAGE_MIB), "--flush-interval", "0.2", "--grace", "5"],
    )
    sc.start()
    w = Writer("hostile-base", trajs=1, tokens=64)
    assert w.session(sc.address, max_new=1, timeout=20).code is None  # declares the run
    yield sc
    sc.kill()


def _req(writer: str, *, seq: int = 1, epoch: int = 1, version: int = 0, n: int = 1) -> pb.WriteRequest:
    recs = make_recs(writer, 0, trajs=n, tokens=16, version=version)
    return pb.WriteRequest(run=SPEC.run, writer=writer, epoch=epoch, sequence=seq, chunks=[x.to_pb() for x in recs])


def _write(sc: Sidecar, messages: list[bytes], timeout: float = 15.0) -> str:
    """Send ``messages`` on one Write stream; the status code name it ends with."""
    with grpc.insecure_channel(sc.address, options=[("grpc.max_send_message_length", 64 * MiB)]) as ch:
        try:
            for _ in ch.stream_stream(WRITE)(iter(messages), timeout=timeout):
                pass
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _unary(sc: Sidecar, method: str, raw: bytes, timeout: float = 15.0) -> str:
    with grpc.insecure_channel(sc.address) as ch:
        try:
            if method == READ:
                for _ in ch.unary_stream(method)(raw, timeout=timeout):
                    pass
            else:
                ch.unary_unary(method)(raw, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


def _chunk_edit(edit: Callable[[pb.Chunk], None], writer: str) -> bytes:
    req = _req(writer)
    edit(req.chunks[0])
    return req.SerializeToString()


def _field(edit: Callable[[pb.WriteRequest], None], writer: str) -> bytes:
    req = _req(writer)
    edit(req)
    return req.SerializeToString()


def _declare(site_edit: Callable[[pb.Site], None], run: str) -> bytes:
    spec = run_spec_to_pb(SPEC)
    spec.run = run
    site_edit(spec.sites[0])
    req = pb.WriteRequest(run=run, writer="decl", epoch=1, sequence=1, run_spec=spec)
    return req.SerializeToString()


def _set(obj: object, **kw: object) -> None:
    for k, v in kw.items():
        setattr(obj, k, v)


INVALID = "INVALID_ARGUMENT"
CASES: list[tuple[str, Callable[[str], list[bytes]], str]] = [
    ("malformed protobuf", lambda w: [b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"], INVALID),
    ("truncated message", lambda w: [_req(w).SerializeToString()[:-7]], INVALID),
    ("bad wire type", lambda w: [b"\x0b\x0c"], INVALID),
    ("oversized message", lambda w: [_oversized(w)], "RESOURCE_EXHAUSTED"),
    ("writer with /", lambda w: [_field(lambda r: _set(r, writer="a/b"), w)], INVALID),
    ("writer ..", lambda w: [_field(lambda r: _set(r, writer=".."), w)], INVALID),
    ("writer with NUL", lambda w: [_field(lambda r: _set(r, writer="a\x00b"), w)], INVALID),
    ("writer 300 chars", lambda w: [_field(lambda r: _set(r, writer="w" * 300), w)], INVALID),
    ("run ../x", lambda w: [_field(lambda r: _set(r, run="../x"), w)], INVALID),
    ("run with NUL", lambda w: [_field(lambda r: _set(r, run="faults\x00"), w)], INVALID),
    ("trajectory ../../etc", lambda w: [_chunk_edit(lambda c: _set(c, trajectory="../../etc/x"), w)], INVALID),
    ("trajectory with /", lambda w: [_chunk_edit(lambda c: _set(c, trajectory="a/b"), w)], INVALID),
    ("trajectory with NUL", lambda w: [_chunk_edit(lambda c: _set(c, trajectory="t\x00"), w)], INVALID),
    ("trajectory 10k chars", lambda w: [_chunk_edit(lambda c: _set(c, trajectory="t" * 10000), w)], INVALID),
    ("site ../x", lambda w: [_chunk_edit(lambda c: _set(c, site="../x"), w)], INVALID),
    ("unknown site", lambda w: [_chunk_edit(lambda c: _set(c, site="layers.9.mlp.input"), w)], INVALID),
    ("negative version", lambda w: [_chunk_edit(lambda c: _set(c, policy_version=-1), w)], INVALID),
    ("negative token_start", lambda w: [_chunk_edit(lambda c: _set(c, token_start=-5), w)], INVALID),
    ("n_tokens 2^40", lambda w: [_chunk_edit(lambda c: _set(c, n_tokens=1 << 40), w)], INVALID),
    ("n_tokens 0", lambda w: [_chunk_edit(lambda c: _set(c, n_tokens=0), w)], INVALID),
    ("token range past 2^63", lambda w: [_chunk_edit(lambda c: _set(c, token_start=(1 << 63) - 8), w)], INVALID),
    ("payload for 0 rows per token", lambda w: [_chunk_edit(lambda c: _set(c, codes=b"", scales=b""), w)], INVALID),
    ("codes 1 byte short", lambda w: [_chunk_edit(lambda c: _set(c, codes=c.codes[:-1]), w)], INVALID),
    (
        "token-scale bytes without flag",
        lambda w: [_chunk_edit(lambda c: _set(c, token_scales=b"\0" * 64, has_token_scales=False), w)],
        INVALID,
    ),  # fmt: skip
    (
        "token-scale flag without bytes",
        lambda w: [_chunk_edit(lambda c: _set(c, token_scales=b"", has_token_scales=True), w)],
        INVALID,
    ),  # fmt: skip
    ("global_scale NaN", lambda w: [_chunk_edit(lambda c: _set(c, global_scale=float("nan")), w)], INVALID),
    ("global_scale negative", lambda w: [_chunk_edit(lambda c: _set(c, global_scale=-1.0), w)], INVALID),
    ("checksum mismatch", lambda w: [_chunk_edit(lambda c: _set(c, checksum=12345), w)], "DATA_LOSS"),
    ("shm reference over TCP", lambda w: [_chunk_edit(lambda c: c.shm.SetInParent(), w)], INVALID),
    ("epoch 0", lambda w: [_field(lambda r: _set(r, epoch=0), w)], INVALID),
    ("sequence 0", lambda w: [_field(lambda r: _set(r, sequence=0), w)], INVALID),
    ("first sequence 5 (gap)", lambda w: [_field(lambda r: _set(r, sequence=5), w)], "FAILED_PRECONDITION"),
    ("undeclared run", lambda w: [_field(lambda r: _set(r, run="nosuchrun"), w)], "NOT_FOUND"),
    ("declare rows_per_token -1", lambda w: [_declare(lambda s: _set(s, rows_per_token=-1), "rpt-neg")], INVALID),
    ("declare width 7", lambda w: [_declare(lambda s: _set(s, width=7), "width-bad")], INVALID),
    ("declare bits 5", lambda w: [_declare(lambda s: _set(s, bits=5), "bits-bad")], INVALID),
    ("declare site ../x", lambda w: [_declare(lambda s: _set(s, name="../x"), "site-bad")], INVALID),
    ("declare format bogus", lambda w: [_declare(lambda s: _set(s, format="fp8"), "fmt-bad")], INVALID),
    ("redeclare run, other sites", lambda w: [_declare(lambda s: _set(s, width=256), SPEC.run)], "ALREADY_EXISTS"),
    ("same key, other bytes", lambda w: [_conflict(w)], "ALREADY_EXISTS"),
]


def _oversized(writer: str) -> bytes:
    """A message past --max-message-mib."""
    req = _req(writer)
    req.chunks[0].token_scales = b"\0" * ((MAX_MESSAGE_MIB + 1) * MiB)
    return req.SerializeToString()


def _conflict(writer: str) -> bytes:
    """The chunk the fixture's base writer stored, with different bytes, from another writer."""
    base = make_recs("hostile-base", 0, trajs=1, tokens=64)[0].to_pb()
    base.codes = bytes(len(base.codes))
    return pb.WriteRequest(run=SPEC.run, writer=writer, epoch=1, sequence=1, chunks=[base]).SerializeToString()


UNARY_CASES: list[tuple[str, str, Callable[[], bytes], str]] = [
    ("Seal malformed", SEAL, lambda: b"\x0a\xff\xff\xff\xff", INVALID),
    (
        "Seal undeclared site",
        SEAL,
        lambda: pb.SealRequest(
            run=SPEC.run,
            writer="seal-x",
            epoch=1,
            sequence=1,
            seals=[pb.TrajectorySeal(trajectory="t", n_tokens=4, sites=["nope"])],
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    (
        "Seal trajectory ../x",
        SEAL,
        lambda: pb.SealRequest(
            run=SPEC.run, writer="seal-y", epoch=1, sequence=1, seals=[pb.TrajectorySeal(trajectory="../x", n_tokens=4)]
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    ("Read malformed", READ, lambda: b"\x12\xff\xff", INVALID),
    (
        "Read trajectory ../x",
        READ,
        lambda: pb.ReadRequest(
            run=SPEC.run, plan=[pb.Segment(trajectory="../x", token_start=0, token_end=4)]
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    (
        "Read end < start",
        READ,
        lambda: pb.ReadRequest(
            run=SPEC.run, plan=[pb.Segment(trajectory="t", token_start=9, token_end=4)]
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    ("Read run ../x", READ, lambda: pb.ReadRequest(run="../x").SerializeToString(), INVALID),
    (
        "Read unknown site",
        READ,
        lambda: pb.ReadRequest(
            run=SPEC.run, plan=[pb.Segment(trajectory="t", token_start=0, token_end=4)], sites=["nope"]
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    (
        "Read columns out of range",
        READ,
        lambda: pb.ReadRequest(
            run=SPEC.run,
            plan=[pb.Segment(trajectory="t", token_start=0, token_end=4)],
            has_columns=True,
            column_start=0,
            column_end=1 << 30,
        ).SerializeToString(),
        INVALID,
    ),  # fmt: skip
    ("Stat malformed", STAT, lambda: b"\x0a\xff\xff", INVALID),
]


def test_hostile_request_table(sidecar: Sidecar) -> None:
    r = row("8 hostile request table")
    got: dict[str, tuple[str, str]] = {}
    for i, (name, build, want) in enumerate(CASES):
        writer = f"hostile-{i}"
        got[name] = (_write(sidecar, build(writer)), want)
    for name, method, build, want in UNARY_CASES:
        got[name] = (_unary(sidecar, method, build()), want)
    # rows_per_token 0 is proto3's "unset": the site is declared with 1 row per token, never 0
    spec = run_spec_to_pb(SPEC)
    spec.run = "rpt-zero"
    spec.sites[0].rows_per_token = 0
    code = _write(sidecar, [pb.WriteRequest(run="rpt-zero", writer="decl", epoch=1, sequence=1,
                                            run_spec=spec).SerializeToString()])  # fmt: skip
    with grpc.insecure_channel(sidecar.address) as ch:
        st = pb.StatResponse.FromString(ch.unary_unary(STAT)(pb.StatRequest(run="rpt-zero").SerializeToString()))
    rpt = [s.rows_per_token for s in st.run_spec.sites] if code == "OK" else []
    got["declare rows_per_token 0"] = (
        "INVALID_ARGUMENT" if code == INVALID else f"{code} rows_per_token={rpt}",
        "INVALID_ARGUMENT or OK rows_per_token=[1, 2]",
    )
    wrong = {k: v for k, v in got.items() if v[0] != v[1] and not (k == "declare rows_per_token 0" and v[0] in v[1])}
    health = sidecar.health()
    r.trials = len(got)
    r.add_note(f"{len(got) - len(wrong)}/{len(got)} as documented; health {health}")
    for k, (g, want) in list(wrong.items())[:4]:
        r.add_note(f"{k}: {g} (want {want})")
    assert sidecar.alive(), sidecar.log()[-2000:]
    assert health == "SERVING"
    assert not wrong, "\n".join(f"{k}: got {g}, want {want}" for k, (g, want) in wrong.items())


def test_nothing_written_outside_the_storage_root(sidecar: Sidecar) -> None:
    """After the table: the work directory holds only what the sidecar and the harness put there."""
    r = row("8 hostile: nothing outside the root")
    r.trials = 1
    top = sorted(p.name for p in sidecar.workdir.iterdir())
    stray = [n for n in top if n not in ("data", "wal") and not n.startswith(("serve-", "ready-"))]
    runs = sorted(p.name for p in sidecar.data_dir.iterdir())
    bad_runs = [n for n in runs if n not in (SPEC.run, "rpt-zero") and not n.startswith(".")]
    escaped = [str(p) for p in sidecar.data_dir.rglob("*") if ".." in p.name or p.name == "etc"]
    for what in (stray, bad_runs, escaped):
        if what:
            r.add_note(f"unexpected {what[:3]}")
    assert not stray and not bad_runs and not escaped, (stray, bad_runs, escaped)


# ---------------------------------------------------------------------------------------------
# fuzz

FUZZ_S = float(os.environ.get("TRACESTORE_FUZZ_S", "20"))
BAD_FUZZ = {"INTERNAL", "UNKNOWN", "DEADLINE_EXCEEDED", "UNAVAILABLE", "CANCELLED"}


def _seeds(rng: random.Random) -> list[tuple[str, bytes]]:
    writer = f"fz{rng.randrange(10**9)}"
    out: list[tuple[str, bytes]] = []
    req = _req(writer, version=5, n=2)
    req.seals.append(pb.TrajectorySeal(policy_version=5, trajectory=f"{writer}.p0.0", n_tokens=16,
                                       sites=[s.name for s in SPEC.sites]))  # fmt: skip
    out.append((WRITE, req.SerializeToString()))
    decl = _req(writer, version=5)
    decl.run_spec.CopyFrom(run_spec_to_pb(SPEC))
    out.append((WRITE, decl.SerializeToString()))
    seal = pb.TrajectorySeal(policy_version=5, trajectory="x", n_tokens=3, sites=[SPEC.sites[0].name])
    out.append((SEAL, pb.SealRequest(run=SPEC.run, writer=writer + "s", epoch=1, sequence=1, seals=[seal])
                .SerializeToString()))  # fmt: skip
    plan = [pb.Segment(trajectory="hostile-base.p0.0", token_start=0, token_end=64)]
    out.append((READ, pb.ReadRequest(run=SPEC.run, plan=plan).SerializeToString()))
    out.append((STAT, pb.StatRequest(run=SPEC.run).SerializeToString()))
    return out


def _mutate(rng: random.Random, data: bytes, other: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and b:  # bit flips
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)) :]
        elif op == 2:  # insert random bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and b:  # duplicate a slice
            i = rng.randrange(len(b))
            j = min(len(b), i + rng.randint(1, 64))
            b[j:j] = b[i:j]
        elif op == 4:  # splice another message
            i = rng.randrange(len(b) + 1)
            k = rng.randrange(len(other) + 1)
            b = b[:i] + bytearray(other[k:])
        elif op == 5:  # a huge varint / length somewhere
            i = rng.randrange(len(b) + 1)
            b[i:i] = b"\xff" * rng.randint(1, 10) + b"\x01"
        elif op == 6:  # an extra field with a random tag and a big length
            tag = (rng.randrange(1, 40) << 3) | rng.choice((0, 1, 2, 5))
            b += bytes([tag & 0x7F]) + struct.pack("<Q", rng.getrandbits(64))[: rng.randint(1, 8)]
        elif op == 7 and len(b) > 2:  # overwrite a byte with an extreme value
            b[rng.randrange(len(b))] = rng.choice((0, 0x7F, 0x80, 0xFF))
    return bytes(b)


@pytest.mark.slow
@pytest.mark.timeout(int(FUZZ_S) + 120)
def test_fuzz_beside_a_good_stream(sidecar: Sidecar) -> None:
    seed = int(os.environ.get("TRACESTORE_FUZZ_SEED", str(random.randrange(1 << 30))))
    r = row(f"8 fuzz {FUZZ_S:.0f} s beside a good stream (seed {seed})")
    rng = random.Random(seed)
    codes: Counter[str] = Counter()
    bad: list[str] = []
    not_serving = 0
    good = Writer("good-writer-main", trajs=4, tokens=64, window=4)
    idle = sidecar.rss()[0]
    with Background(good, sidecar.address, session_s=5.0, pace_s=0.05) as bg:
        end = time.monotonic() + FUZZ_S
        n = 0
        while time.monotonic() < end:
            seeds = _seeds(rng)
            method, raw = rng.choice(seeds)
            mutated = _mutate(rng, raw, rng.choice(seeds)[1])
            if method == WRITE:
                msgs = [mutated] if rng.random() < 0.7 else [raw, mutated]
                code = _write(sidecar, msgs, timeout=10)
            else:
                code = _unary(sidecar, method, mutated, timeout=10)
            codes[code] += 1
            if code in BAD_FUZZ and len(bad) < 5:
                bad.append(f"{method.rsplit('/', 1)[1]} {code}: {mutated[:64].hex()}")
            n += 1
            if n % 25 == 0 and sidecar.health(timeout=2) != "SERVING":
                not_serving += 1
        bg.phase = "after"
    r.trials = n
    r.rss_mib = (sidecar.rss()[1] - idle) / 1024
    alive = sidecar.alive()
    health = sidecar.health() if alive else "dead"
    drained = good.drain(sidecar.address, timeout=30) if alive else False
    settled = alive and wait_until(lambda: converged(sidecar, good.writer), 30, 0.2)
    chk = verify(sidecar.storage, good.acked_recs, versions=[0])
    r.acked, r.lost, r.duplicated = chk.acked, chk.lost_total, chk.duplicated
    r.add_note(f"codes {dict(codes.most_common(6))}")
    good_codes = {c: k for ph in bg.codes.values() for c, k in ph.items() if c != "CLIENT_TIMEOUT"}
    problems = []
    if not alive:
        problems.append(f"the sidecar died: {sidecar.log()[-1500:]}")
    if health != "SERVING" or not_serving:
        problems.append(f"health {health}, NOT_SERVING in {not_serving} probes")
    if bad:
        problems.append(f"{sum(codes[c] for c in BAD_FUZZ)} bad statuses, e.g. {bad}")
    if good_codes:
        problems.append(f"the good stream was interrupted: {good_codes}")
    if not drained or not settled:
        r.wedged = 1
        problems.append("the good writer's records did not all commit")
    if not chk.ok():
        problems.append(str(chk))
    for p in problems[:3]:
        r.add_note(p[:200])
    assert not problems, "\n".join(problems)
