"""``check``, ``demo`` and ``health`` on the typed settings layer of ``tracestore.cli``: a bad
``TRACESTORE_*`` value is one line naming the variable, the value and what is expected (exit 2, no
traceback); the ``[check]`` and ``[demo]`` tables of a config file sit below variables and flags;
``--help`` shows a default and a variable for every flag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tests.cli.helpers import run_main as _run
from tracestore.cli import SECTIONS, build_parser, resolve

BAD = [
    (["check", "file:///x", "--refs", "r.jsonl"], {"TRACESTORE_VERSIONS": "1,x"},
     "TRACESTORE_VERSIONS='1,x': expected comma-separated policy versions (integers >= 0)"),
    (["check", "file:///x", "--refs", "r.jsonl"], {"TRACESTORE_JSON": "maybe"},
     "TRACESTORE_JSON='maybe': expected true or false"),
    (["check", "file:///x", "--refs", "r.jsonl"], {"TRACESTORE_SITES": "a,,b"},
     "TRACESTORE_SITES='a,,b': expected comma-separated site names"),
    (["check", "file:///x", "--refs", "r.jsonl"], {"TRACESTORE_STORAGE_OPTIONS": '{"key": "hunter2"'},
     "TRACESTORE_STORAGE_OPTIONS=<redacted>: expected a JSON object"),
    (["check", "file:///x", "--plan", "p.json", "--versions", "-1"], {},
     "--versions='-1': expected comma-separated policy versions"),
    (["demo"], {"TRACESTORE_LAYERS": "0"}, "TRACESTORE_LAYERS='0': expected an integer (at least 1)"),
    (["demo"], {"TRACESTORE_HIDDEN": "wide"}, "TRACESTORE_HIDDEN='wide': expected an integer"),
    (["demo"], {"TRACESTORE_TOKENS": "1"}, "TRACESTORE_TOKENS='1': expected an integer (at least 2)"),
    (["demo"], {"TRACESTORE_BITS": "5"}, "TRACESTORE_BITS='5': expected an integer in 1..4"),
    (["demo"], {"TRACESTORE_RULE": "round"}, "TRACESTORE_RULE='round': expected one of bracket, paper"),
    (["demo"], {"TRACESTORE_FORMAT": "fp8"}, "TRACESTORE_FORMAT='fp8': expected one of nvfp4, mxfp4"),
    (["demo"], {"TRACESTORE_LR": "fast"}, "TRACESTORE_LR='fast': expected a number >= 0"),
    (["demo"], {"TRACESTORE_PROGRESS": "sometimes"}, "TRACESTORE_PROGRESS='sometimes': expected true or false"),
    (["demo"], {"TRACESTORE_TRANSPORT": "pigeon"}, "TRACESTORE_TRANSPORT='pigeon': expected one of auto, service"),
    (["demo", "--steps", "0"], {}, "--steps='0': expected an integer (at least 1)"),
    (["health"], {"TRACESTORE_TIMEOUT": "0"}, "TRACESTORE_TIMEOUT='0': expected a number > 0"),
    (["health"], {"TRACESTORE_TIMEOUT": "soon"}, "TRACESTORE_TIMEOUT='soon': expected a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "line"), BAD, ids=[f"{a[0]}-{'-'.join(e) or a[-2]}" for a, e, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(argv, env, line, monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # demo must not get as far as writing anything
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _run(argv, capsys)
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"tracestore {argv[0]}: ") and line in lines[0], err
    assert "Traceback" not in err and "hunter2" not in err and out == ""
    assert list(tmp_path.iterdir()) == []


def _ns(argv: list[str]) -> argparse.Namespace:
    return resolve(build_parser().parse_args(argv))


def test_demo_table_below_env_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "tracestore.toml"
    conf.write_text(
        "[demo]\n"
        "layers = 2\n"
        "hidden = 64\n"
        "top-k = 1\n"  # dashes or underscores
        'rule = "paper"\n'
        "lr = 0.01\n"
        "progress = false\n"
        'device = "cpu"\n'
        "[check]\n"
        "json = true\n"
    )
    monkeypatch.setenv("TRACESTORE_CONFIG", str(conf))
    monkeypatch.setenv("TRACESTORE_HIDDEN", "128")
    monkeypatch.setenv("TRACESTORE_LAYERS", "3")
    ns = _ns(["demo", "--layers", "4"])
    assert (ns.layers, ns._sources["layers"]) == (4, "flag")  # flag > env > file
    assert (ns.hidden, ns._sources["hidden"]) == (128, "env")  # env > file
    assert (ns.top_k, ns.rule, ns.lr, ns.progress, ns.device) == (1, "paper", 0.01, False, "cpu")  # file
    assert ns._sources["top_k"] == "file"
    assert (ns.experts, ns.storage, ns.out, ns._sources["experts"]) == (8, None, "tracestore-demo", "default")
    assert _ns(["demo", "--progress"]).progress is True
    assert _ns(["demo"]).progress is False and _ns(["demo", "--no-progress"])._sources["progress"] == "flag"
    other = tmp_path / "other.toml"
    other.write_text("[demo]\nsteps = 5\n")
    ns = _ns(["demo", "--config", str(other)])  # --config beats TRACESTORE_CONFIG
    assert (ns.steps, ns.layers, ns.rule) == (5, 3, "bracket")


def test_check_table_below_env_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "tracestore.toml"
    conf.write_text(
        "[check]\n"
        'run = "run-file"\n'
        "versions = [0, 2]\n"  # a TOML array or a comma-separated string
        'sites = "moe_in,k"\n'
        'plan = "plan.json"\n'
        "json = true\n"
        "[check.storage_options]\n"
        "anon = true\n"
    )
    monkeypatch.setenv("TRACESTORE_CONFIG", str(conf))
    ns = _ns(["check", "file:///x"])
    assert (ns.run, ns.versions, ns.sites, ns.plan, ns.json) == ("run-file", [0, 2], ["moe_in", "k"], "plan.json", True)
    assert ns.storage_options == {"anon": True} and ns._sources["run"] == "file"
    monkeypatch.setenv("TRACESTORE_RUN", "run-env")
    monkeypatch.setenv("TRACESTORE_VERSIONS", "3")
    ns = _ns(["check", "file:///x", "--versions", "4,5", "--no-json"])
    assert (ns.run, ns.versions, ns.json) == ("run-env", [4, 5], False)
    from tracestore.cli.check import source

    assert source(ns) == (None, "plan.json")
    # --refs beats a plan of a lower source; both from one source is a usage error
    assert source(_ns(["check", "file:///x", "--refs", "r.jsonl"])) == ("r.jsonl", None)
    monkeypatch.setenv("TRACESTORE_REFS", "env.jsonl")
    assert source(_ns(["check", "file:///x"])) == ("env.jsonl", None)
    assert source(_ns(["check", "file:///x", "--plan", "p2.json"])) == (None, "p2.json")


def test_check_refs_or_plan_usage_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = _run(["check", "file:///x"], capsys)
    assert rc == 2 and out == "" and err.startswith("tracestore check: give --refs FILE or --plan FILE"), err
    rc, out, err = _run(["check", "file:///x", "--refs", "a", "--plan", "b"], capsys)
    assert rc == 2 and err.strip() == "tracestore check: --refs and --plan both given (flag): give one", err
    monkeypatch.setenv("TRACESTORE_REFS", "a")
    monkeypatch.setenv("TRACESTORE_PLAN", "b")
    rc, out, err = _run(["check", "file:///x"], capsys)
    assert rc == 2 and "both given (env)" in err and len(err.splitlines()) == 1, err


def test_health_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACESTORE_TARGET", "127.0.0.1:1")
    monkeypatch.setenv("TRACESTORE_SERVICE", "tracestore.v1.Liveness")
    monkeypatch.setenv("TRACESTORE_TIMEOUT", "0.5")
    ns = _ns(["health"])
    assert (ns.target, ns.service, ns.timeout) == ("127.0.0.1:1", "tracestore.v1.Liveness", 0.5)
    ns = _ns(["health", "--service", "", "--target", "unix:///tmp/x.sock"])
    assert (ns.target, ns.service) == ("unix:///tmp/x.sock", "")
    monkeypatch.setenv("TRACESTORE_TARGET", "off")  # the default target
    assert _ns(["health"]).target is None


@pytest.mark.parametrize("name", ["check", "demo", "health"])
def test_help_shows_a_default_and_a_variable_for_every_flag(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    p = sub.choices[name]
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and "(default: " in action.help, f"{name} {action.option_strings[0]}: {action.help}"
    flat = " ".join(p.format_help().split())
    for s in SECTIONS[name]:
        assert f"(default: {s.shown_default()}; env {s.env_name})" in flat, (name, s.flag)
    assert "(default: none; env TRACESTORE_CONFIG)" in flat
    rc, out, err = _run([name, "--help"], capsys)
    assert rc == 0 and out.startswith(f"usage: tracestore {name}") and err == ""


def test_help_of_the_three_names_their_defaults() -> None:
    helps = {}
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("check", "demo", "health"):
        helps[name] = " ".join(sub.choices[name].format_help().split())
    for name, shown in [
        ("check", "(default: all; env TRACESTORE_VERSIONS)"),
        ("check", "(default: off; env TRACESTORE_JSON)"),
        ("demo", "(default: qwen3_moe; env TRACESTORE_ARCH)"),
        ("demo", "(default: 8; env TRACESTORE_LAYERS)"),
        ("demo", "(default: 0.0001; env TRACESTORE_LR)"),
        ("demo", "(default: on; env TRACESTORE_PROGRESS)"),
        ("health", "(default: 3.0; env TRACESTORE_TIMEOUT)"),
        ("health", "127.0.0.1:$TRACESTORE_PORT; env TRACESTORE_TARGET)"),
    ]:
        assert shown in helps[name], (name, shown)
    assert "--no-progress" in helps["demo"] and "--refs FILE" in helps["check"]
