"""The isolation, memory and stop findings of the sidecar's adversarial review, each bound to the
tests that show it fixed; ``tests/conftest.py`` prints the table (finding, goal, tests passed /
run, verdict) at the end of every run that collects them, so CI's log shows where each stands.

A finding whose tests were not collected (a narrower run) is left out of the table; one whose tests
were collected but skipped shows ``skipped``, which is not ``at goal``.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    what: str
    goal: str
    tests: tuple[str, ...]  # node-id prefixes ("file.py::test_name" or "file.py")


FINDINGS: tuple[Finding, ...] = (
    Finding("no --auth-tokens: any local user reaches TCP", "unix socket only unless TCP is asked for; --port off",
            ("tests/cli/test_serve_start.py::test_port_off_serves_the_unix_socket_only",
             "tests/security/test_unix_socket.py::test_without_tokens_tcp_listens_beside_the_socket_only_when_asked")),
    Finding("a unix peer's uid rule on every RPC", "every RPC of a peer checked against its uid rule",
            ("tests/security/test_peer_auth.py",)),
    Finding("untaken Read responses hold the ingest budget", "a read budget of its own, per-identity shares, deadline",
            ("tests/security/test_read_budget.py",)),
    Finding("a read-only loop of tiny Reads forces shards", "at most one read-forced commit per flush interval",
            ("tests/security/test_read_flushes.py",)),
    Finding("57 MiB messages, 256 MiB budget: RSS +741 MiB", "peak RSS - idle <= budget + 64 MiB",
            ("tests/faults/test_rss_bounds.py::test_rss_large_messages",)),
    Finding("S3 refused / black-holed / wiped, 300 streams with storage down", "peak RSS - idle <= budget + 64 MiB",
            ("tests/faults/test_rss_bounds.py::test_rss_s3_outage",
             "tests/faults/test_rss_bounds.py::test_rss_300_streams_storage_down")),
    Finding("a newcomer's first ack behind 300 idle streams: ~59 s", "<= 2 s behind any number of idle streams",
            ("tests/security/test_idle_stream_turns.py", "tests/security/test_stream_shares.py")),
    Finding("shm pool slots are sidecar-wide", "a share of the pools per identity",
            ("tests/security/test_shm_shares.py", "tests/security/test_shm_pools.py")),
    Finding("SIGHUP revocation leaves open streams writing", "open streams of a revoked token end within 1 s",
            ("tests/security/test_revocation.py",)),
    Finding("a clean restart frees sealed trajectories to other identities", "owners durable across restarts",
            ("tests/security/test_ownership_durable.py", "tests/security/test_ownership.py")),
    Finding("SIGTERM waits the whole grace for an empty stream", "exit <= 2 s with nothing queued; the log says why",
            ("tests/server/test_crash.py::test_sigterm_ends_a_write_stream_that_admitted_nothing_at_once",
             "tests/server/test_gauges_shutdown.py::test_stop_with_an_empty_stream_is_prompt_and_logs_no_shard_write")),
    Finding("token files of mode 0644/0660/0664/0620 accepted", "group/world-writable refused, world-readable warned",
            ("tests/security/test_auth.py::test_a_token_file_its_group_can_write_is_refused",
             "tests/security/test_auth.py::test_a_token_file_every_user_can_read_loads_with_a_warning")),
    Finding("a WAL cut below its fsynced bytes loses acked entries", "refused at start, naming segment and offset",
            ("tests/faults/test_wal_damage.py::test_acknowledged_tail_cut_by_damage_refuses_to_start",
             "tests/server/wal/test_durable.py")),
    Finding("low: expired server certificate", "refused at start and on reload; warned before expiry",
            ("tests/security/test_tls_validity.py",)),
    Finding("low: CRC-valid undecodable WAL entry", "refused naming its segment and offset",
            ("tests/faults/test_wal_damage.py::test_checksum_valid_entry_that_does_not_decode_names_its_segment",)),
    Finding("low: token_start 2^62 accepted", "token positions end by 2^40",
            ("tests/records/test_records.py::test_seals_and_links_end_by_two_to_the_forty",)),
    Finding("low: 'Task exception was never retrieved' in S3 logs", "none, with connections reset",
            ("tests/faults/test_s3_outage.py::test_s3_resetting_connections_leave_no_unretrieved_task_errors",
             "tests/storage/test_timeouts.py::test_reset_connections_leave_no_unretrieved_task_exception")),
)  # fmt: skip


def format_findings(outcomes: dict[str, str]) -> str:
    """The table from ``outcomes`` ({nodeid: "passed" | "failed" | "skipped"}); findings none of
    whose tests ran are left out."""
    rows = []
    for f in FINDINGS:
        ran = {n: o for n, o in outcomes.items() if any(n == t or n.startswith(t + "::") or
                                                         n.startswith(t + "[") for t in f.tests)}  # fmt: skip
        if not ran:
            continue
        passed = sum(o == "passed" for o in ran.values())
        failed = sum(o == "failed" for o in ran.values())
        verdict = "NOT AT GOAL" if failed else "at goal" if passed == len(ran) else "skipped"
        rows.append((f.what, f.goal, f"{passed}/{len(ran)}", verdict))
    if not rows:
        return ""
    head = ("finding", "goal", "tests passed", "verdict")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join
    out = [line(h.ljust(w) for h, w in zip(head, widths, strict=True)), line("-" * w for w in widths)]
    out += [line(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)
