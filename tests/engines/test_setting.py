"""The plugins' one setting (``tracestore.client.engines.setting``): the rank placeholders of
``sidecar=`` — parsed and refused at start, filled per recording process, and end to end two
engine recorders of one template (two data-parallel replicas) each writing to their own real
sidecar over its unix socket."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tracestore.client.engines.recording import EngineRecorder
from tracestore.client.engines.rows import RowMapper, Scheduled
from tracestore.client.engines.setting import PluginRegistration, parse_setting, placeholders
from tracestore.server.testing import ServeProcess

from tracestore import Store, StoreReader
from tracestore.errors import ConfigError

BASE = "run=r policy_version=0 writer=w"


@pytest.mark.parametrize(
    ("sidecar", "fields", "address"),
    [
        ("127.0.0.1:7433", (), "127.0.0.1:7433"),
        ("unix:///run/ts/{rank}.sock", ("rank",), "unix:///run/ts/5.sock"),
        ("unix:///run/ts/{dp_rank}-{rank:02d}.sock", ("dp_rank", "rank"), "unix:///run/ts/2-05.sock"),
        ("127.0.0.1:74{dp_rank}{dp_rank}", ("dp_rank",), "127.0.0.1:7422"),
    ],
)
def test_sidecar_placeholders_are_filled_with_the_process_ranks(
    sidecar: str, fields: tuple[str, ...], address: str
) -> None:
    s = parse_setting(f"sidecar={sidecar} {BASE}")
    assert s.placeholders == fields
    assert s.address({"rank": 5, "dp_rank": 2}) == address


@pytest.mark.parametrize(
    ("sidecar", "said"),
    [
        ("unix:///run/ts/{gpu}.sock", "unknown placeholder {gpu}"),
        ("unix:///run/ts/{}.sock", "unknown placeholder {}"),
        ("unix:///run/ts/{0}.sock", "unknown placeholder {0}"),
        ("unix:///run/ts/{rank.real}.sock", "unknown placeholder {rank.real}"),
        ("unix:///run/ts/{rank.sock", "not a valid address template"),
        ("unix:///run/ts/rank}.sock", "not a valid address template"),
        ("unix:///run/ts/{rank:q}.sock", "not a valid address template"),
    ],
)
def test_a_bad_template_is_refused_when_parsed(sidecar: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        parse_setting(f"sidecar={sidecar} {BASE}")
    with pytest.raises(ConfigError):
        placeholders(sidecar)


def test_a_plugin_with_a_bad_template_refuses_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry point parses the setting before anything is installed: vLLM then does not start."""
    monkeypatch.setenv("TRACESTORE_RECORD", f"sidecar=unix:///run/{{host}}.sock {BASE}")
    installed: list[object] = []
    with pytest.raises(ConfigError, match=r"unknown placeholder \{host\}"):
        PluginRegistration("vllm", ("0.32.0",)).register(lambda: "0.32.0", installed.append)
    assert not installed


def test_a_rank_the_plugin_did_not_report_is_an_error() -> None:
    s = parse_setting(f"sidecar=unix:///run/{{dp_rank}}.sock {BASE}")
    with pytest.raises(ConfigError, match=r"needs \{dp_rank\}"):
        s.address({"rank": 0})
    with pytest.raises(ConfigError, match=r"needs \{dp_rank\}"):
        s.address(None)
    with pytest.raises(ConfigError, match=r"needs \{dp_rank\}"):
        s.address({"rank": 0, "dp_rank": -1})
    with pytest.raises(ConfigError, match=r"needs \{dp_rank\}"):
        EngineRecorder(s).address()  # no plugin set its ranks


def test_two_replicas_of_one_template_record_to_their_own_sidecars(tmp_path: Path) -> None:
    sidecars = [ServeProcess(tmp_path / str(d), unix_socket=True, flags=["--flush-interval", "0.2"]) for d in (0, 1)]
    for sp in sidecars:
        sp.start()
    try:
        text = f"sidecar=unix://{tmp_path}/{{dp_rank}}/sidecar.sock run=dp policy_version=0 bits=1"
        ended = []
        for dp in (0, 1):
            rec = EngineRecorder(parse_setting(f"{text} writer=w{dp}"))
            rec.ranks = lambda dp=dp: {"rank": 2 * dp, "dp_rank": dp}  # type: ignore[misc]
            assert rec.address() == sidecars[dp].unix_address
            mapper = RowMapper()
            mapper.add(f"req{dp}", [1, 2, 3])
            plan = mapper.step([Scheduled(f"req{dp}", 0, 3, 0, [1, 2, 3])])
            codes = torch.full((3, 4), 16 + dp, dtype=torch.uint8)
            rec.capture("layers.0.mlp.input", codes, torch.full((3, 2), 0x38, dtype=torch.uint8), torch.ones(1))
            assert rec.end_forward(plan)
            ended.append(rec.end_request(mapper.finish(f"req{dp}", [1, 2, 3, 4])))
            assert rec.close(30)
        assert [e["gap"] for e in ended] == [None, None]
    finally:
        for sp in sidecars:
            sp.terminate()
    for dp, sp in enumerate(sidecars):
        with StoreReader(Store(sp.storage), "dp") as reader:
            mine = reader.read([(f"req{dp}::a0", 0, 4)], on_missing="mask")["layers.0.mlp.input"]
            other = reader.read([(f"req{1 - dp}::a0", 0, 4)], on_missing="mask")["layers.0.mlp.input"]
        assert mine.valid.tolist() == [True, True, True, False]
        assert np.all(mine.codes[:3] == 16 + dp)
        assert not other.valid.any()  # the other replica's rows went to its own sidecar


def test_sglang_ranks_come_from_its_parallel_context() -> None:
    """SGLang's replicas each build their own WORLD group: ``rank`` numbers the recording
    processes across replicas as vLLM's world group does (``dp_rank × world size + world rank``)."""
    pytest.importorskip("sglang", reason="SGLang is not installed here: the engine venv (.ci/engines-venv) runs this")
    from sglang.srt.runtime_context import get_parallel
    from tracestore.client.engines.sglang.ranks import engine_ranks

    p = get_parallel()
    with p.override(launch_world_rank=1, launch_world_size=2, dp_rank=3, tp_size=2, pp_size=1, tp_rank=1, pp_rank=0):
        assert engine_ranks() == {"rank": 7, "dp_rank": 3}
    with p.override(launch_world_rank=0, launch_world_size=1, dp_rank=None, tp_size=1, pp_size=1):
        assert engine_ranks() == {"rank": 0, "dp_rank": 0}  # no data-parallel controller
