"""Storage retries (tracestore.storage.fs.Storage.call, tenacity): exponential backoff with jitter, at most
``retries`` retries, and no retry started after the total deadline (the argument; the sidecar's
from ``--storage-retry-deadline``)."""

from __future__ import annotations

import time

import pytest
from tracestore.server.cli import config_from_args

from tracestore.cli import build_parser
from tracestore.errors import ConfigError, StorageError
from tracestore.settings import resolve
from tracestore.storage.config import StorageConfig
from tracestore.storage.fs import DEFAULT_RETRY_DEADLINE_S, RETRY_DEADLINE_ENV, Storage, backoff_wait
from tracestore.storage.store import Store


class _Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.times: list[float] = []

    def __call__(self) -> str:
        self.times.append(time.monotonic())
        if len(self.times) <= self.failures:
            raise ConnectionError("connection reset")
        return "ok"


def test_backoff_has_jitter_within_equal_jitter_bounds() -> None:
    from tenacity import RetryCallState

    wait = backoff_wait(0.5, 10.0)
    for n, (lo, hi) in enumerate([(0.25, 0.5), (0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (5.0, 10.0)], 1):
        state = RetryCallState(None, None, (), {})
        state.attempt_number = n
        draws = [wait(state) for _ in range(200)]
        assert all(lo <= d <= hi for d in draws), (n, min(draws), max(draws))
        assert len({round(d, 6) for d in draws}) > 100  # jittered, not one fixed step


def test_retries_transient_errors_then_succeeds() -> None:
    events: list[str] = []
    st = Storage("memory://retry-ok", retries=3, backoff=0.02, on_event=lambda k, op, d: events.append(k))
    fn = _Flaky(2)
    assert st.call("read x", fn) == "ok"
    assert len(fn.times) == 3 and st.stats["retries"] == 2 and events == ["retry", "retry"]


def test_deadline_stops_retries_before_the_count() -> None:
    st = Storage("memory://retry-deadline", retries=1000, backoff=0.05, max_backoff=0.1, retry_deadline=0.5)
    fn = _Flaky(10**6)
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=r"read x on memory://retry-deadline failed after \d+ attempt\(s\)"):
        st.call("read x", fn)
    elapsed = time.monotonic() - t0
    assert elapsed < 0.5 + 0.1 + 0.1  # no retry starts after the deadline (one wait at most past it is refused)
    assert 3 <= len(fn.times) < 20 and fn.times[-1] - fn.times[0] < 0.5


def test_count_still_bounds_retries() -> None:
    st = Storage("memory://retry-count", retries=2, backoff=0.01)
    fn = _Flaky(10**6)
    with pytest.raises(StorageError, match="failed after 3 attempt"):
        st.call("read x", fn)
    assert len(fn.times) == 3 and st.stats["retries"] == 2 and st.stats["errors"] == 1


def test_permanent_errors_are_not_retried() -> None:
    st = Storage("memory://retry-permanent", retries=5, backoff=0.01)
    calls = []

    def denied() -> None:
        calls.append(1)
        raise PermissionError("no")

    with pytest.raises(StorageError, match="permission denied"):
        st.call("write x", denied)
    assert len(calls) == 1 and st.stats["retries"] == 0


def test_deadline_comes_from_the_sidecars_settings_not_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RETRY_DEADLINE_ENV, "2.5")
    # the storage package reads no environment: a Storage made without a deadline has the default
    assert Storage("memory://d0").retry_deadline == DEFAULT_RETRY_DEADLINE_S
    assert Storage("memory://d2", retry_deadline=7).retry_deadline == 7.0
    # the sidecar's setting (flag > variable > file) travels in its StorageConfig to its Store
    cfg = config_from_args(build_parser().parse_args(["serve"]))
    assert cfg.storage_config().retry_deadline_s == 2.5
    store = Store("memory://d3", config=cfg.storage_config())
    assert store.storage.retry_deadline == 2.5
    cfg = config_from_args(build_parser().parse_args(["serve", "--storage-retry-deadline", "4"]))
    assert Store("memory://d4", config=cfg.storage_config()).storage.retry_deadline == 4.0
    monkeypatch.setenv(RETRY_DEADLINE_ENV, "soon")
    with pytest.raises(ConfigError, match=f"{RETRY_DEADLINE_ENV}='soon': expected a number > 0"):
        config_from_args(resolve(build_parser().parse_args(["serve"])))
    with pytest.raises(ConfigError, match="StorageConfig.retry_deadline_s=0: expected a number of seconds > 0"):
        StorageConfig(retry_deadline_s=0)


def test_no_retry_starts_after_the_deadline_when_a_wait_overshoots(monkeypatch: pytest.MonkeyPatch) -> None:
    # a loaded host wakes a sleeper late: each backoff wait (0.05-0.1 s) ends 0.3 s late, so the
    # third attempt's wait, planned to end before the 0.5 s deadline, ends past it
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: real_sleep(s + 0.3))
    st = Storage("memory://retry-overshoot", retries=1000, backoff=0.05, max_backoff=0.1, retry_deadline=0.5)
    fn = _Flaky(10**6)
    with pytest.raises(StorageError, match=r"failed after 2 attempt\(s\)") as err:
        st.call("read x", fn)
    assert isinstance(err.value.__cause__, ConnectionError)
    assert len(fn.times) == 2 and fn.times[-1] - fn.times[0] < 0.5
