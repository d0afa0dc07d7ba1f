"""The ``monitor`` and ``top`` subcommands, through a parser built as cli.py builds it."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tensorferry.monitor._cli import _check, _options, add_subcommands

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
        opts = _options(ns)
        sel, cfg = opts.selection, opts.config
        assert sel.pids == (1, 2) and sel.pattern == "ray::" and sel.tree_root_pid == 3 and sel.all_processes
        assert cfg.interval_seconds == 0.5 and cfg.cpu_budget_fraction == pytest.approx(0.002) and cfg.cgroups
        assert ns.json and opts.duration_seconds == 2 and opts.port == 0
        assert ns.host == "127.0.0.1"
    assert callable(long_.func) and long_.check is _check
    top = _options(parser().parse_args(["top", "-p", "5", "-s", "uss", "-n", "10"]))
    assert (top.selection.pids, top.sort_by, top.limit) == ((5,), "uss", 10)


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
    # Not "exited between listing and reading": the pid never existed.
    assert re.match(r"NoSuchProcess: --pid/-p \d+: no process has this id \(it never existed", err), err
    assert "between listing and reading" not in err and len(err.splitlines()) == 1


BAD_OPTIONS = [
    (["monitor", "--budget", "lots"], "--budget/-b 'lots': must be a fraction of one core"),
    (["monitor", "-b", "0"], "--budget/-b '0': must be a fraction"),
    (["monitor", "-b", "150%"], "--budget/-b '150%'"),
    (["monitor", "-i", "0"], "--interval/-i '0': must be a number of seconds > 0"),
    (["monitor", "-i", "nan"], "--interval/-i 'nan'"),
    (["monitor", "--max-stall", "-1"], "--max-stall '-1'"),
    (["monitor", "-d", "soon"], "--duration/-d 'soon'"),
    (["monitor", "-p", "-5"], "--pid/-p '-5': must be a process id"),
    (["monitor", "-p", "x"], "--pid/-p 'x'"),
    (["monitor", "-t", "0"], "--tree/-t '0'"),
    (["monitor", "-P", "70000"], "--port/-P '70000': must be a port in 0..65535"),
    (["monitor", "-k", "("], "Selection(pattern='(') is not a valid regular expression"),
    (["top", "-n", "-3"], "--limit/-n '-3': must be a number of rows >= 1"),
    (["top", "-s", "size"], "--sort/-s 'size': must be one of rss, uss, pss, anon, shmem, swap, cpu"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_OPTIONS)
def test_bad_values_are_one_line_usage_errors(capsys, argv, message) -> None:  # type: ignore[no-untyped-def]
    # Through the real entry point: checked before anything is built.
    from tensorferry.cli import main

    assert main([*argv, "-d", "0.1"] if "-d" not in argv else argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ConfigurationError: "), captured.err
    assert message in lines[0]
    # A caller that runs the verb without cli.main's check gets the same.
    assert run([*argv, "-d", "0.1"] if "-d" not in argv else argv) == 2
    assert capsys.readouterr().err.splitlines() == lines


def test_port_in_use_is_a_usage_error(capsys) -> None:  # type: ignore[no-untyped-def]
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert run(["monitor", "-p", str(os.getpid()), "-P", str(port), "-d", "0.1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ConfigurationError: serve_prometheus(host='127.0.0.1', port={port}): cannot bind")


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
        m = re.match(r"serving (http://127\.0\.0\.1:\d+)/metrics and (http://\S+/healthz)", line)
        assert m, line
        base = m.group(1)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"tensorferry_process_resident_bytes", "tensorferry_processes",
                "tensorferry_monitor_sample_seconds"} <= names
        # /healthz is one short line, not the metrics page; / says where things are.
        with urllib.request.urlopen(m.group(2), timeout=10) as resp:
            assert resp.status == 200
            health = resp.read().decode()
        assert health.startswith("ok: last tick ") and health.count("\n") == 1 and "tensorferry_" not in health
        with urllib.request.urlopen(base + "/", timeout=10) as resp:
            assert "/metrics" in resp.read().decode()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(base + "/nothing", timeout=10)
        assert missing.value.code == 404
    finally:
        proc.terminate()
        proc.wait(10)


def test_top_once_prints_one_table_and_json_one_object(start_target) -> None:  # type: ignore[no-untyped-def]
    """`top --once` and `top --json` in a real process, without a terminal or stdin."""
    t = start_target("big", "16")
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1"}
    once = subprocess.run([sys.executable, "-c", RUN_CLI, "top", "--once", "-p", str(t.pid)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert once.returncode == 0, once.stderr
    assert once.stdout.count("tensorferry top") == 1 and str(t.pid) in once.stdout
    assert "q quits" not in once.stdout
    js = subprocess.run([sys.executable, "-c", RUN_CLI, "top", "--json", "-p", str(t.pid)],
                        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL, env=env)
    assert js.returncode == 0, js.stderr
    (line,) = js.stdout.splitlines()
    rec = json.loads(line)
    (proc,) = rec["processes"]
    assert proc["pid"] == t.pid and proc["rss_bytes"] >= 16 << 20
    # The name label comes from the command line (the fixture script), not the comm.
    assert proc["group"] == "target.py" and proc["name"] != proc["group"]
    assert rec["groups"][0]["name"] == "target.py" and rec["monitor"]["ticks"] == 1



def test_monitor_verbs_run_where_torch_cannot_be_imported() -> None:
    """The monitor stands beside the transfer stack: `top --json` and a
    served scrape work in a process where importing torch fails."""
    code = (
        "import sys, os, urllib.request\n"
        "sys.modules['torch'] = None  # any import of torch raises ImportError\n"
        "from tensorferry.cli import main\n"
        "assert main(['top', '--json', '-p', str(os.getpid())]) == 0\n"
        "from tensorferry.monitor import Agent, Selection, serve_prometheus\n"
        "agent = Agent(Selection(pids=(os.getpid(),)))\n"
        "agent.tick()\n"
        "with serve_prometheus(agent, port=0) as s:\n"
        "    text = urllib.request.urlopen(s.url, timeout=10).read().decode()\n"
        "assert 'tensorferry_process_resident_bytes' in text\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[0])["processes"]
