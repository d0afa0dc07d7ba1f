"""The command line, run as a user runs it: real processes, real exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "UCX_NET_DEVICES": "lo", "COLUMNS": "200", "NO_COLOR": "1"}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tensorferry", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_info_lists_versions_and_backends():
    out = run("info")
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    import tensorferry

    assert rows["tensorferry"].strip() == tensorferry.__version__
    assert rows["python"].strip() == sys.version.split()[0]
    assert rows["torch"].strip().startswith("2.")
    backends = [b.strip() for b in rows["backends"].split(",")]
    assert "pool" in backends and "tcp" in backends
    assert "shm" in backends  # Linux
    assert "cuda" in rows
    # Issue 28: the C extensions and the optional dependencies, found or not.
    import importlib.util

    parts = rows["c-extensions"].strip().split("; ")
    modules = ("copy._memcpy", "tensors._ptrs", "plans._diff", "monitor._still")  # every C extension, by the layer that loads it
    assert len(parts) == len(modules), parts
    for part, module in zip(parts, modules):
        built = importlib.util.find_spec(f"tensorferry.{module}") is not None
        assert part == f"{module}: built" if built else part.startswith(f"{module}: not built (")
    from tensorferry.cli._info import OPTIONAL

    for dist, _ in OPTIONAL:
        assert rows[dist].strip()[0].isdigit() or rows[dist].startswith("not installed (needed by ")
    assert rows["rich"].strip()[0].isdigit()  # a dependency of top


def test_console_script_runs():
    script = Path(sys.executable).with_name("tensorferry")
    if not script.exists():
        pytest.skip("the tensorferry console script is not installed in this environment")
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("tensorferry ")


@pytest.mark.timeout(240)
def test_demo_runs_and_prints_the_table():
    out = run("demo", "--size-mib", "32", "--tensors", "200", "--repeats", "1", "--no-progress", timeout=220)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "tensorferry demo" in text
    for column in ("scenario", "tensors", "GB/s", "blocks", "copy runs", "verified"):
        assert column in text, column
    pool_rows = [line for line in text.splitlines() if "pool (pack+unpack)" in line]
    assert len(pool_rows) == 1
    assert "yes" in pool_rows[0] and " NO " not in text


@pytest.mark.parametrize(
    "args",
    [
        ("demo", "--no-such-option"),
        ("demo", "--size-mib", "lots"),
        ("no-such-verb",),
        (),
    ],
    ids=["unknown option", "bad value", "unknown verb", "no verb"],
)
def test_bad_usage_exits_2(args):
    out = run(*args, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stderr)
    # One line, ErrorType: message, pointing at --help.
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("UsageError: tensorferry"), out.stderr
    assert "--help" in lines[0]
    assert out.stdout == ""


def test_errors_print_type_and_message_and_exit_1(monkeypatch, capsys):
    from tensorferry import cli
    from tensorferry.errors import PoolExhaustedError

    def fail(args):
        raise PoolExhaustedError(100, 10, 10, 64)

    monkeypatch.setattr(cli, "_cmd_info", fail)
    assert cli.main(["info"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("PoolExhaustedError: pool cannot hold 100 bytes")


def test_version_option():
    out = run("--version", timeout=60)
    assert out.returncode == 0
    import tensorferry

    assert out.stdout.strip() == f"tensorferry {tensorferry.__version__}"


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("-n", "0"), "--tensors 0"),
        (("-n", "3"), "--tensors 3"),
        (("-n", "100000000"), "--tensors 100000000"),
        (("-r", "0", "-t", "pool"), "--repeats 0"),
        (("-r", "-1"), "--repeats -1"),
        (("-t", "foo"), "'foo'"),
        (("-t", "pool,,tcp"), "''"),
        (("-s", "-5"), "--size-mib -5"),
        (("-s", "0"), "--size-mib 0"),
        (("-s", str(1 << 40)), f"--size-mib {1 << 40}"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else None,
)
def test_demo_rejects_bad_values_before_building_anything(args, named):
    out = run("demo", "--no-progress", *args, timeout=60)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    # Nothing was built: the demo's first line ("building a synthetic
    # state dict") never printed.
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("ConfigurationError: "), lines[0]
    assert named in lines[0], lines[0]


def test_demo_rejects_a_transport_this_machine_lacks():
    from tensorferry.transports import available

    missing = [t for t in ("shm", "tcp", "nixl") if t not in available()]
    if not missing:
        pytest.skip("every transport is available here")
    out = run("demo", "-t", missing[0], timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("ConfigurationError: ") and "not available" in out.stderr
