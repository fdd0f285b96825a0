"""Configuration of the ``tracestore`` command: flag > TRACESTORE_ variable > TOML config file > default,
every value checked once; a bad one is a single line naming the flag, variable or file key, the value
and what is expected, with exit status 2 and no traceback, and it fails only the subcommand that reads it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tracestore.server.cli import config_from_args

from tests.cli.helpers import run_main as _run
from tracestore.cli import SECTIONS, build_parser

# (argv, environment, what the one error line must contain)
BAD = [
    (["serve"], {"TRACESTORE_PORT": "abc"}, "TRACESTORE_PORT='abc': expected an integer in 0..65535"),
    (["serve"], {"TRACESTORE_PORT": "70000"}, "TRACESTORE_PORT='70000': expected an integer in 0..65535"),
    (["serve", "--port", "abc"], {}, "--port='abc': expected an integer in 0..65535"),
    (["serve"], {"TRACESTORE_MEMORY_BUDGET_MIB": "1.5"}, "TRACESTORE_MEMORY_BUDGET_MIB='1.5': expected an integer"),
    (["serve"], {"TRACESTORE_FLUSH_INTERVAL": "0"}, "TRACESTORE_FLUSH_INTERVAL='0': expected a number > 0"),
    (["serve"], {"TRACESTORE_GRACE": "nan"}, "TRACESTORE_GRACE='nan': expected a number > 0"),
    (["serve"], {"TRACESTORE_INSECURE": "maybe"}, "TRACESTORE_INSECURE='maybe': expected true or false"),
    (["serve"], {"TRACESTORE_METRICS_PORT": "x"}, "TRACESTORE_METRICS_PORT='x': expected an integer in 0..65535"),
    (["serve"], {"TRACESTORE_SOCKET_MODE": "999"}, "TRACESTORE_SOCKET_MODE='999': expected an octal file mode"),
    (["serve"], {"TRACESTORE_LOG_LEVEL": "loud"}, "TRACESTORE_LOG_LEVEL='loud': expected one of debug, info"),
    (["serve"], {"TRACESTORE_WORKERS": "4"}, "TRACESTORE_WORKERS='4': expected an integer >= 8"),
    (["serve"], {"TRACESTORE_STORAGE_CHECK": "maybe"}, "TRACESTORE_STORAGE_CHECK='maybe': expected one of warn"),
    (["serve"], {"TRACESTORE_STORAGE_RETRY_DEADLINE": "-1"}, "TRACESTORE_STORAGE_RETRY_DEADLINE='-1': expected"),
    (["serve"], {"TRACESTORE_STORAGE": ""}, "TRACESTORE_STORAGE='': expected an fsspec URL"),
    (["serve"], {"TRACESTORE_STORAGE_OPTIONS": '{"secret": "hunter2"'},
     "TRACESTORE_STORAGE_OPTIONS=<redacted>: expected a JSON object"),
    (["inspect", "file:///x"], {"TRACESTORE_POLICY_VERSION": "-1"}, "TRACESTORE_POLICY_VERSION='-1': expected an"),
    (["inspect", "file:///x"], {"TRACESTORE_JOBS": "x"}, "TRACESTORE_JOBS='x': expected an integer >= 0"),
    (["inspect", "file:///x"], {"TRACESTORE_TIMEOUT": "0"}, "TRACESTORE_TIMEOUT='0': expected a number > 0"),
    (["inspect", "file:///x", "--policy-version", "v3"], {}, "--policy-version='v3': expected an integer >= 0"),
    (["inspect", "file:///x", "--version", "0.1.0"], {}, "--policy-version='0.1.0': expected an integer"),
    (["selftest"], {"TRACESTORE_TOKENS": "many"}, "TRACESTORE_TOKENS='many': expected an integer >= 1"),
    (["selftest"], {"TRACESTORE_WIDTH": "33"}, "TRACESTORE_WIDTH='33': expected a multiple of 32"),
    (["selftest"], {"TRACESTORE_NOISE": "-1"}, "TRACESTORE_NOISE='-1': expected a number >= 0"),
    (["serve"], {"TRACESTORE_CONFIG": "/nonexistent/tracestore.toml"},
     "TRACESTORE_CONFIG='/nonexistent/tracestore.toml': cannot read it"),
    (["serve", "--config", "/nonexistent/t.toml"], {}, "--config='/nonexistent/t.toml': cannot read it"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "env", "line"), BAD, ids=[f"{a[0]}-{'-'.join(e) or a[-1]}" for a, e, _ in BAD])
def test_bad_value_is_one_line_and_exit_2(argv, env, line, monkeypatch, capsys) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc, out, err = _run(argv, capsys)
    lines = [x for x in err.splitlines() if "is deprecated" not in x]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"tracestore {argv[0]}: ") and line in lines[0], err
    assert "Traceback" not in err and "hunter2" not in err and out == ""


def test_a_bad_variable_fails_only_the_subcommand_that_reads_it(monkeypatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setenv("TRACESTORE_PORT", "abc")
    monkeypatch.setenv("TRACESTORE_LAYERS", "abc")  # a demo flag (flag + env only, tracestore.cli.env_default)
    for argv in (["--help"], ["serve", "--help"], ["inspect", "--help"], ["demo", "--help"]):
        rc, out, err = _run(argv, capsys)
        assert rc == 0 and "usage: tracestore" in out and err == "", (argv, err)
    rc, out, err = _run(["inspect", tmp_path.as_uri()], capsys)  # reads no port: runs (and finds nothing)
    assert rc == 3 and "TRACESTORE_PORT" not in err
    rc, out, err = _run(["demo"], capsys)
    assert rc == 2 and err.strip() == "tracestore demo: TRACESTORE_LAYERS='abc': expected an integer", err


def test_version_variable_is_not_the_policy_version(monkeypatch, capsys, tmp_path: Path) -> None:
    """TRACESTORE_VERSION (an image or package version in many environments) is read by nothing."""
    monkeypatch.setenv("TRACESTORE_VERSION", "0.1.0")
    rc, _, err = _run(["inspect", tmp_path.as_uri()], capsys)
    assert rc == 3 and "0.1.0" not in err and "Traceback" not in err


def test_help_text_and_default_for_every_flag() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name in ("serve", "inspect", "selftest"):
        p = sub.choices[name]
        help_text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert action.help, f"{name} {flag} has no help"
            assert "default:" in action.help or "deprecated spelling" in action.help, f"{name} {flag}: {action.help}"
            assert flag in help_text
        for s in SECTIONS[name]:
            assert s.env_name in " ".join(help_text.split()), f"{name} help does not name {s.env_name}"


def test_serve_help_shows_the_defaults() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    env["COLUMNS"] = "400"  # no wrapping inside a default
    out = subprocess.run([sys.executable, "-m", "tracestore", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True, env=env).stdout  # fmt: skip
    flat = " ".join(out.split())
    for shown in (
        "(default: 7433; env TRACESTORE_PORT)",
        "(default: file://./tracestore-data; env TRACESTORE_STORAGE)",
        "(default: 1024; env TRACESTORE_MEMORY_BUDGET_MIB)",
        "(default: ./tracestore-wal; env TRACESTORE_WAL_DIR)",
        "(default: none; env TRACESTORE_CONFIG)",
    ):
        assert shown in flat, shown


def test_a_bad_value_from_the_command_line_tool_itself_has_no_traceback(tmp_path: Path) -> None:
    """The installed entry point, end to end: variables, a cross-field limit the ServerConfig checks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACESTORE_")}
    cases = [
        ({"TRACESTORE_PORT": "abc"}, ["serve"], "TRACESTORE_PORT='abc'"),
        ({"TRACESTORE_MAX_MESSAGE_MIB": "600"}, ["serve", "--storage", "memory://x", "--wal-dir", "off"],
         "max_message_bytes"),
    ]  # fmt: skip
    for extra, argv, needle in cases:
        proc = subprocess.run([sys.executable, "-m", "tracestore", *argv], capture_output=True, text=True,
                              timeout=60, env={**env, **extra}, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr
        assert len([x for x in proc.stderr.splitlines() if x.startswith("tracestore serve:")]) == 1, proc.stderr


# ---------------------------------------------------------------------------- config file


def _serve(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_precedence_flag_env_file_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "tracestore.toml"
    conf.write_text(
        "[serve]\n"
        'storage = "memory://from-file"\n'
        "port = 7001\n"
        "memory-budget-mib = 512\n"  # dashes or underscores
        "metrics_port = 7101\n"
        "insecure = false\n"
        'socket_mode = "0640"\n'
        "[serve.storage_options]\n"
        'endpoint_url = "http://127.0.0.1:9000"\n'
        "[inspect]\n"
        "jobs = 2\n"
    )
    monkeypatch.setenv("TRACESTORE_CONFIG", str(conf))
    monkeypatch.setenv("TRACESTORE_PORT", "7002")
    monkeypatch.setenv("TRACESTORE_METRICS_PORT", "off")
    ns = _serve(["--port", "7003"])
    cfg = config_from_args(ns)
    assert cfg.port == 7003 and ns._sources["port"] == "flag"  # flag > env > file
    assert cfg.metrics_port is None and ns._sources["metrics_port"] == "env"  # env > file
    assert cfg.storage == "memory://from-file" and ns._sources["storage"] == "file"  # file > default
    assert cfg.memory_budget_bytes == 512 << 20 and cfg.socket_mode == 0o640
    assert cfg.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert cfg.wal_segment_bytes == 64 << 20 and ns._sources["wal_segment_mib"] == "default"
    assert ns.config == str(conf)
    # --config beats TRACESTORE_CONFIG; a flag still beats the file
    other = tmp_path / "other.toml"
    other.write_text("[serve]\nport = 7004\nshard_target_mib = 32\n")
    monkeypatch.delenv("TRACESTORE_PORT")
    cfg = config_from_args(_serve(["--config", str(other)]))
    assert (cfg.port, cfg.shard_target_bytes, cfg.storage) == (7004, 32 << 20, "file://./tracestore-data")


def test_switch_from_file_env_and_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "t.toml"
    conf.write_text("[serve]\nunix_needs_token = true\nauth_tokens = '/nonexistent/tokens'\n")
    ns = _serve(["--config", str(conf)])
    assert config_from_args(ns).unix_needs_token is True
    monkeypatch.setenv("TRACESTORE_UNIX_NEEDS_TOKEN", "0")
    assert config_from_args(_serve(["--config", str(conf)])).unix_needs_token is False
    assert config_from_args(_serve(["--config", str(conf), "--unix-needs-token"])).unix_needs_token is True


BAD_FILES = [
    ('[serve]\nport = "abc"\n', "[serve] port='abc': expected an integer in 0..65535"),
    ("[serve]\nport = 7433\nprot = 1\n", "[serve] has no setting 'prot' (did you mean 'port'?)"),
    ("[srve]\nport = 1\n", "unknown table [srve]"),
    ("port = 1\n", "'port' is outside a table; put settings under [serve]"),
    ("[serve]\nport = \n", "not valid TOML"),
    ('[serve]\ninsecure = "perhaps"\n', "[serve] insecure='perhaps': expected true or false"),
    ("[serve]\nmemory_budget_mib = 1.5\n", "[serve] memory_budget_mib=1.5: expected an integer >= 1"),
    ("[serve.storage_options]\nsecret = 1\n[serve]\nstorage_options = 2\n", "not valid TOML"),
]


@pytest.mark.parametrize(("content", "line"), BAD_FILES)
def test_bad_config_file_is_one_line_and_exit_2(content, line, tmp_path, capsys) -> None:
    conf = tmp_path / "bad.toml"
    conf.write_text(content)
    rc, out, err = _run(["serve", "--config", str(conf)], capsys)
    assert rc == 2 and len(err.splitlines()) == 1 and line in err and "Traceback" not in err, err


def test_storage_options_file_beats_a_lower_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret = tmp_path / "opts.json"
    secret.write_text('{"anon": true}')
    secret.chmod(0o600)
    monkeypatch.setenv("TRACESTORE_STORAGE_OPTIONS", '{"anon": false}')
    assert config_from_args(_serve(["--storage-options-file", str(secret)])).storage_options == {"anon": True}
    assert config_from_args(_serve([])).storage_options == {"anon": False}
    from tracestore.errors import ConfigError

    monkeypatch.setenv("TRACESTORE_STORAGE_OPTIONS_FILE", str(secret))
    with pytest.raises(ConfigError, match="not both"):
        config_from_args(_serve([]))
