"""The Grafana dashboard and the Prometheus rules in monitoring/ against what a
real ``tensorferry monitor`` serves: every metric name and label a panel, a
variable, a recording rule or an alert uses exists in a scrape of a running
monitor (and of a process serving its pools). promtool, where installed,
checks and unit-tests the rules and lints the scrape."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "monitoring" / "grafana" / "tensorferry-dashboard.json"
BUILDER = REPO / "monitoring" / "grafana" / "build_dashboard.py"
RULES = REPO / "monitoring" / "prometheus" / "tensorferry-rules.yml"
RULES_TEST = REPO / "monitoring" / "prometheus" / "tensorferry-rules.test.yml"
# Labels Prometheus adds to every scraped series (the target's), not the exporter.
TARGET_LABELS = frozenset({"job", "instance"})
METRIC = re.compile(r"\b((?:[a-z_]+:)?tensorferry_[a-z_]+(?::[a-z0-9_]+)?)\b(\{[^}]*\})?")
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


# -- reading PromQL (what the queries use) ---------------------------------------


def _matcher_labels(braces: str | None) -> set[str]:
    return set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", braces or ""))


def _balanced(text: str, start: int) -> str:
    """The parenthesised group starting at or after ``start``."""
    i = text.index("(", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return text[i: j + 1]
    raise AssertionError(f"unbalanced parentheses in {text!r}")


def uses(expr: str) -> Iterator[tuple[str, set[str]]]:
    """``(metric, labels it must carry)`` for every metric an expression reads:
    labels in its own matchers, and those of every ``by (...)`` around it."""
    for m in GROUPING.finditer(expr):
        # The checker knows by() only: a query using another grouping must
        # make it learn that one first, rather than pass unchecked.
        assert m.group(1) == "by", f"{m.group(1)}(...) in {expr!r}: teach this test what it groups"
        labels = {x.strip() for x in m.group(2).split(",") if x.strip()}
        inner = _balanced(expr, m.end())
        for metric in METRIC.finditer(inner):
            yield metric.group(1), labels
    for m in METRIC.finditer(expr):
        yield m.group(1), _matcher_labels(m.group(2))
    for m in re.finditer(r"label_values\(\s*((?:[a-z_]+:)?tensorferry_\w+)[^,]*,\s*(\w+)\s*\)", expr):
        yield m.group(1), {m.group(2)}


def rule_blocks(text: str) -> list[dict[str, str]]:
    """The rules of a rules file: ``record``/``alert``, ``expr`` and the rest of its text."""
    blocks: list[dict[str, str]] = []
    for chunk in re.split(r"\n\s*- (?=record:|alert:)", text)[1:]:
        kind, name = re.match(r"(record|alert): (\S+)", chunk).groups()  # type: ignore[union-attr]
        m = re.search(r"\n\s*expr: (?:\|\n((?:\s{10,}.*\n?)+)|(.*))", chunk)
        assert m, chunk
        expr = " ".join((m.group(1) or m.group(2)).split())
        blocks.append({"kind": kind, "name": name, "expr": expr, "text": chunk})
    return blocks


def dashboard_queries(dash: dict) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


# -- a running monitor and a process serving its pools ---------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def served(text: str) -> dict[str, set[str]]:
    """Sample name -> the labels its samples carry (HELP-only families count, with none)."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        out.setdefault(family.name, set())
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory) -> Iterator[dict[str, tuple[str, str]]]:  # type: ignore[no-untyped-def]
    """``{"monitor": (url, text), "pools": (url, text)}``: one scrape of
    `tensorferry monitor -c` (a process, a whole core of budget so its USS is
    read at the first tick) and one of a process that serves a Sender's pool
    and a Receiver's cache (no agent: pools only)."""
    from monitor_helpers import Target

    target = Target("big", "16")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    mon = subprocess.Popen(
        [sys.executable, "-m", "tensorferry", "monitor", "-p", str(target.pid), "-c", "-b", "1", "-P", "0",
         "-i", "0.2", "-d", "120"],
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
    )
    try:
        line = mon.stderr.readline()  # type: ignore[union-attr]
        m = re.match(r"serving (\S+/metrics)", line)
        assert m, line
        with _pool_endpoint() as pools:
            yield {"monitor": (m.group(1), scrape(m.group(1))), "pools": pools}
    finally:
        mon.terminate()
        mon.wait(10)
        target.close()


@pytest.fixture(scope="module")
def scrapes(endpoints: dict[str, tuple[str, str]]) -> str:
    """Both endpoints' scrapes as one text."""
    return "\n".join(text for _, text in endpoints.values())


@contextlib.contextmanager
def _pool_endpoint() -> Iterator[tuple[str, str]]:
    """A pools-only endpoint (a Sender's pool and a Receiver's cache), up
    while the caller runs: its URL and a first scrape."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: no Sender to serve a pool")
    import tensorferry
    from tensorferry.monitor import register_pool_source, serve_prometheus, unregister_pool_source

    with tensorferry.Sender("shm", capacity_nbytes=1 << 20) as sender, \
            tensorferry.Receiver("shm", cache_nbytes=1 << 20) as receiver:
        register_pool_source("weights", sender.stats, role="sender")
        try:
            with serve_prometheus(None, port=0) as server:
                yield server.url, scrape(server.url)
        finally:
            unregister_pool_source("weights")
        assert receiver is not None


def test_every_metric_and_label_used_is_served(scrapes: str) -> None:
    have = served(scrapes)
    dash = json.loads(DASHBOARD.read_text())
    rules = rule_blocks(RULES.read_text())
    recorded: dict[str, set[str]] = {}
    checked = 0

    def check(expr: str, where: str) -> set[str]:
        """Asserts the expression's metrics and labels exist; returns the labels its result can carry."""
        nonlocal checked
        result: set[str] = set(TARGET_LABELS)
        names = [m.group(1) for m in METRIC.finditer(expr)]
        assert names, f"{where}: no tensorferry metric in {expr!r}"
        for metric, labels in uses(expr):
            known = recorded.get(metric, have.get(metric))
            assert known is not None, f"{where}: {metric} is not served (query {expr!r})"
            missing = labels - known - TARGET_LABELS
            assert not missing, f"{where}: {metric} has no label(s) {sorted(missing)} (query {expr!r})"
            result |= known
            checked += 1
        top = re.match(r"\s*\w+\s+by\s*\(([^)]*)\)", expr)
        return TARGET_LABELS | {x.strip() for x in top.group(1).split(",")} if top else result

    for expr in dashboard_queries(dash):
        check(expr, "dashboard")
    for rule in rules:
        labels = check(rule["expr"], f"{rule['kind']} {rule['name']}")
        if rule["kind"] == "record":
            recorded[rule["name"]] = labels
        for templated in re.findall(r"\$labels\.(\w+)", rule["text"]):
            assert templated in labels, f"alert {rule['name']}: $labels.{templated} is not on its series"
    assert checked >= 40
    assert {r["name"] for r in rules if r["kind"] == "alert"} >= {
        "TensorferryProcessGroupMemoryGrowing", "TensorferryUssNearCgroupLimit", "TensorferryPoolNearFull",
        "TensorferryMonitorTickLate", "TensorferryMonitorOverBudget", "TensorferryExactFiguresStale",
    }


def test_the_checker_catches_a_wrong_name_and_a_wrong_label(scrapes: str) -> None:
    have = served(scrapes)
    (metric, labels), *_ = uses('sum by (name) (tensorferry_process_resident_bytes{kind="anon"})')
    assert metric == "tensorferry_process_resident_bytes" and labels == {"name"}
    found = list(uses('sum by (nme) (tensorferry_process_resident_bytes{kind="anon"})'))
    assert any(lab - have[m] - TARGET_LABELS for m, lab in found)  # "nme" is caught
    assert "tensorferry_process_memory_bytes" not in have  # the name before issue 28
    # Pools are labelled without the pid: the Sender as registered, the
    # Receiver's cache as it registers itself (receive-cache:<pid>:<n>).
    assert have["tensorferry_pool_used_bytes"] == {"pool", "role"}
    assert 'tensorferry_pool_used_bytes{pool="weights",role="sender"}' in scrapes
    assert re.search(r'tensorferry_pool_used_bytes\{pool="receive-cache:\d+",role="receive-cache"\}', scrapes)
    assert f":{os.getpid()}:" not in scrapes


def test_dashboard_json_is_what_the_builder_writes() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboard", BUILDER)
    builder = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(builder)  # type: ignore[union-attr]
    assert DASHBOARD.read_text() == builder.render(), "run python monitoring/grafana/build_dashboard.py"
    assert sorted(dashboard_queries(json.loads(DASHBOARD.read_text()))) == sorted(builder.queries())


def test_promtool_checks_and_unit_tests_the_rules_and_lints_the_scrape(scrapes: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus); "
                    "the metric and label check above ran without it")
    for args in (["check", "rules", RULES.name], ["test", "rules", RULES_TEST.name]):
        out = subprocess.run([promtool, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    lint = subprocess.run([promtool, "check", "metrics"], input=scrapes, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _variable(dash: dict, name: str) -> str:
    return next(v["query"]["query"] for v in dash["templating"]["list"] if v["name"] == name)


def test_the_instance_variable_lists_monitors_and_pool_only_endpoints(endpoints: dict[str, tuple[str, str]]) -> None:
    """Picking one instance must not hide the pool panels: the variable's
    metric is served by the monitor and by a process serving only its pools."""
    query = _variable(json.loads(DASHBOARD.read_text()), "instance")
    m = re.fullmatch(r'label_values\(\{__name__=~"([\w|]+)"\}, instance\)', query)
    assert m, query
    names = m.group(1).split("|")
    for kind, (_, text) in endpoints.items():
        assert set(names) & set(served(text)), f"the {kind} endpoint serves none of {names}: its instance is not listed"
    assert "tensorferry_monitor_interval_seconds" not in served(endpoints["pools"][1])  # the one metric it used before


PROMETHEUS_YML = REPO / "monitoring" / "prometheus" / "prometheus.yml"


def test_the_prometheus_config_scrapes_what_is_served(endpoints: dict[str, tuple[str, str]], tmp_path: Path) -> None:
    """monitoring/prometheus/prometheus.yml: its rule files exist, each job's
    path is what the endpoints serve (scraped again here at that path), the
    monitor's target is `tensorferry monitor`'s default port, and promtool
    (where installed) accepts the config with its rules."""
    import yaml

    from tensorferry.monitor._server import DEFAULT_PORT

    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    for rules in config["rule_files"]:
        assert (PROMETHEUS_YML.parent / rules).resolve() == RULES
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"tensorferry-monitor", "tensorferry-pools"}
    wants = {"tensorferry-monitor": ("monitor", "tensorferry_monitor_interval_seconds"),
             "tensorferry-pools": ("pools", "tensorferry_pool_capacity_bytes")}
    for name, (endpoint, metric) in wants.items():
        job = jobs[name]
        url = endpoints[endpoint][0]
        served_at = re.match(r"(https?://[^/]+)(/.*)", url)
        assert served_at and job.get("scheme", "http") == url.split(":")[0]
        text = scrape(served_at.group(1) + job.get("metrics_path", "/metrics"))
        assert metric in served(text), f"job {name}: {metric} is not served at {job.get('metrics_path')}"
        targets = [t for sc in job["static_configs"] for t in sc["targets"]]
        assert targets and all(re.fullmatch(r"[\w.-]+:\d+", t) for t in targets), targets
    assert jobs["tensorferry-monitor"]["static_configs"][0]["targets"] == [f"127.0.0.1:{DEFAULT_PORT}"]
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus): the config was checked "
                    "against the live endpoints above, not by promtool")
    shutil.copy(PROMETHEUS_YML, tmp_path / "prometheus.yml")
    shutil.copy(RULES, tmp_path / RULES.name)
    out = subprocess.run([promtool, "check", "config", "prometheus.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
