"""The ``monitor`` and ``top`` subcommands, through a parser built as cli.py builds it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorferry.monitor._cli import add_subcommands

RUN_CLI = (
    "import argparse, sys\n"
    "from tensorferry.monitor._cli import add_subcommands\n"
    "p = argparse.ArgumentParser(prog='tensorferry')\n"
    "add_subcommands(p.add_subparsers(dest='command', required=True))\n"
    "a = p.parse_args(sys.argv[1:])\n"
    "sys.exit(a.func(a))\n"
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorferry")
    add_subcommands(p.add_subparsers(dest="command", required=True))
    return p


def run(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def test_short_aliases_parse_like_long_options() -> None:
    long_ = parser().parse_args(
        ["monitor", "--pid", "1", "--pid", "2", "--pattern", "ray::", "--tree", "3", "--all",
         "--interval", "0.5", "--budget", "0.2%", "--json", "--cgroup", "--duration", "2", "--port", "0"]
    )
    short = parser().parse_args(
        ["monitor", "-p", "1", "-p", "2", "-k", "ray::", "-t", "3", "-a", "-i", "0.5", "-b", "0.002",
         "-j", "-c", "-d", "2", "-P", "0"]
    )
    for ns in (long_, short):
        assert ns.pid == [1, 2] and ns.pattern == "ray::" and ns.tree == 3 and ns.all
        assert ns.interval == 0.5 and ns.budget == pytest.approx(0.002)
        assert ns.json and ns.cgroup and ns.duration == 2 and ns.port == 0
        assert ns.host == "127.0.0.1"
    assert callable(long_.func)
    top = parser().parse_args(["top", "-p", "5", "-s", "uss", "-n", "10"])
    assert (top.pid, top.sort, top.limit) == ([5], "uss", 10)


def test_monitor_json_lines(capsys, start_target) -> None:  # type: ignore[no-untyped-def]
    t = start_target("big", "16")
    rc = run(["monitor", "--json", "-p", str(t.pid), "-i", "0.2", "-d", "0.5"])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert 2 <= len(lines) <= 4
    records = [json.loads(line) for line in lines]
    for rec in records:
        (proc,) = rec["processes"]
        assert proc["pid"] == t.pid and proc["rss_bytes"] >= 16 << 20
        assert proc["uss_source"] in ("pagemap", "smaps_rollup", "none")
        assert set(rec["errors"]) == {"vanished", "zombie", "denied"}
        assert rec["monitor"]["rss_bytes"] > 0
    assert records[0]["processes"][0]["uss_source"] == "pagemap"
    assert records[-1]["monitor"]["ticks"] == len(records)


def test_missing_pid_fails_with_typed_error(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = run(["monitor", "--json", "-p", str(2**22 + 4321), "-d", "0.1"])
    assert rc == 1
    err = capsys.readouterr().err
    assert re.match(r"NoSuchProcess: pid \d+", err)


def test_usage_errors_exit_2(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["monitor", "--budget", "lots"])
    assert info.value.code == 2
    assert "budget must be a fraction" in capsys.readouterr().err
    rc = run(["monitor", "--json", "-k", "(", "-d", "0.1"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("ValueError: pattern '(' is not a valid regular expression")


def test_top_runs_bounded_without_a_tty(capsys) -> None:  # type: ignore[no-untyped-def]
    rc = run(["top", "-p", str(os.getpid()), "-i", "0.1", "-d", "0.3"])
    assert rc == 0
    assert str(os.getpid()) in capsys.readouterr().out


def test_monitor_serves_metrics_on_loopback(start_target) -> None:  # type: ignore[no-untyped-def]
    t = start_target("sleep")
    proc = subprocess.Popen(
        [sys.executable, "-c", RUN_CLI, "monitor", "-p", str(t.pid), "--port", "0", "-i", "0.2", "-d", "20"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stderr.readline()  # type: ignore[union-attr]
        m = re.match(r"serving (http://127\.0\.0\.1:\d+/metrics)", line)
        assert m, line
        with urllib.request.urlopen(m.group(1), timeout=10) as resp:
            text = resp.read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"tensorferry_process_memory_bytes", "tensorferry_monitor_sample_seconds"} <= names
    finally:
        proc.terminate()
        proc.wait(10)
