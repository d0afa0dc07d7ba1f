"""The hand-kept reference pages against the code they describe: every
stats() key, metric family, error class, environment variable and command
line option the code has is on its page, and the error table's tested
cases raise what it says."""

from __future__ import annotations

import inspect
import itertools
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import tensorferry as tf
import tensorferry.errors

REPO = Path(__file__).resolve().parents[2]
REF = REPO / "docs" / "reference"


def _table_keys(page: str, section: str) -> set[str]:
    """The first-column names of the table under ``## section``."""
    text = (REF / page).read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", body, re.M))


def test_every_stats_key_is_defined() -> None:
    with tf.Sender("tcp", capacity_nbytes=1 << 20) as s, tf.Receiver("tcp", relay=True) as r:
        assert set(s.stats()) == _table_keys("stats.md", "`Sender.stats()`")
        assert set(r.stats()) == _table_keys("stats.md", "`Receiver.stats()`")
        assert set(s.pool.stats()._fields) == _table_keys("stats.md", "`MemoryPool.stats()` (a `PoolStats`)")
    from tensorferry.ray import SyncReport
    assert set(SyncReport._fields) == _table_keys("stats.md", "`tensorferry.ray.SyncReport` (what `WeightSync.sync()` returns)")


def _families(page_text: str) -> set[str]:
    """Metric names on the page, with ``{a,b}`` alternatives spelled out."""
    names: set[str] = set()
    for m in re.finditer(r"`(tensorferry_[a-z_{},]+)`", page_text):
        name = m.group(1)
        alt = re.search(r"\{([a-z_,]+)\}", name)
        names.update(name.replace(alt.group(0), a) for a in alt.group(1).split(",")) if alt else names.add(name)
    return names


def test_every_metric_family_served_is_listed() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tensorferry.monitor import Agent, AgentConfig, Selection, register_pool_source, serve_prometheus, unregister_pool_source

    agent = Agent(Selection(pids=(os.getpid(),)), AgentConfig(interval_seconds=0.2, cgroups=True, cpu_budget_fraction=1.0))
    agent.start()
    try:
        with tf.Sender("shm", capacity_nbytes=1 << 20) as sender:
            register_pool_source("weights", sender.stats, role="sender")
            try:
                with serve_prometheus(agent, port=0) as server:
                    for _ in range(50):  # the first tick
                        if agent.latest is not None:
                            break
                        time.sleep(0.1)
                    text = urllib.request.urlopen(server.url, timeout=10).read().decode()
            finally:
                unregister_pool_source("weights")
    finally:
        agent.stop()
    served = {f.name for f in text_string_to_metric_families(text)}
    # prometheus_client names a counter's family without _total; the page uses the sample name.
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    listed = _families((REF / "metrics.md").read_text().split("## Renamed series")[0])
    missing = {f for f in served if f not in listed and f + "_total" not in listed}
    assert not missing, f"served but not in docs/reference/metrics.md: {sorted(missing)}"
    assert len(served) >= 25 and "tensorferry_pool_capacity_bytes" in samples


def test_the_error_table_is_the_error_classes() -> None:
    text = (REF / "errors.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", text, re.M))
    classes = {n: c for n, c in inspect.getmembers(tensorferry.errors, inspect.isclass)
               if issubclass(c, Exception) and c.__module__ == "tensorferry.errors"}
    assert set(rows) == set(classes)
    for name, cls in classes.items():
        bases = [b.__name__ for b in cls.__bases__ if b is not tf.TensorferryError or name == "MonitorError"]
        assert re.findall(r"`(\w+)`", rows[name]) == bases, f"{name}: the page says {rows[name]}, the code {bases}"


def test_the_error_tables_tested_cases() -> None:
    """The cases the table marks *(tested)*, raised for real."""
    with tf.Sender("tcp", capacity_nbytes=1 << 20) as s, tf.Receiver("tcp", timeout=5.0) as r:
        t = s.put({"w": torch.ones(4)})
        r.get(t)
        with pytest.raises(tf.TransferError):  # every reader already released it
            r.get(t)
        with pytest.raises(tf.LayoutMismatchError):
            r.get(s.put({"w": torch.ones(4)}), into={"w": torch.ones(5)})
        bad = bytearray(t.to_bytes())
        with pytest.raises(tf.TicketError, match="pass the bytes Ticket.to_bytes"):
            r.get(bytes(bad[:-2]))
        for no_ticket in (None, t.to_bytes().hex()):
            with pytest.raises(tf.TicketError, match=r"a ticket is a Ticket .* or the bytes of its to_bytes\(\)"):
                r.get(no_ticket)
        planned = torch.ones(4)
        stale = s.plan({"w": planned})
        planned.resize_(100)  # moves its memory: the plan is stale
        with pytest.raises(tf.PlanStaleError):
            s.put(stale)
        with pytest.raises(tf.TransferTimeoutError):
            s.wait_released(s.put({"w": torch.ones(4)}), timeout=0.1)
        with pytest.raises(tf.UnsupportedTensorError):
            s.put({"w": torch.ones(4).to_sparse()})
        with pytest.raises(tf.UnsupportedTensorError, match="is a int, not a tensor"):
            s.put({"w": torch.ones(4), "step": 7})
        got = r.get(s.put({"a": np.arange(3.0)}))  # numeric numpy arrays are sent, as torch tensors
        assert torch.equal(got["a"], torch.arange(3.0, dtype=torch.float64))
    with pytest.raises(tf.PeerGoneError):
        with tf.Receiver("tcp", timeout=5.0) as r2:
            r2.get(t)  # its sender is closed
    closed = tf.Receiver("tcp")
    closed.close()
    with pytest.raises(tf.ConfigurationError):  # not a TransferError: the README once said so
        closed.get(t)
    with pytest.raises(tf.ConfigurationError):
        tf.Receiver("bogus")


def test_every_environment_variable_is_listed() -> None:
    used = set()
    for path in (REPO / "src" / "tensorferry").rglob("*.py"):
        used |= set(re.findall(r"TENSORFERRY_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    listed = set(re.findall(r"^\| `(TENSORFERRY_\w+)` \|", (REF / "environment.md").read_text(), re.M))
    assert used == listed


def test_every_command_line_option_is_accepted() -> None:
    text = (REF / "cli.md").read_text()
    for verb in ("info", "demo", "monitor", "top"):
        body = text.split(f"## `tensorferry {verb}`\n", 1)[1].split("\n## ", 1)[0]
        options = re.findall(r"^\| (`-[^|]+) \|", body, re.M)
        helptext = subprocess.run([sys.executable, "-m", "tensorferry", verb, "--help"], capture_output=True, text=True,
                                  timeout=60).stdout
        for cell in options:
            for option in re.findall(r"`(-[-\w]+)`", cell):
                assert re.search(rf"(^|[\s,]){re.escape(option)}\b", helptext), f"tensorferry {verb} has no {option}"
        if verb in ("monitor", "top"):
            documented = {o for cell in options for o in re.findall(r"`(--[-\w]+)`", cell)}
            if verb == "top":  # top also takes monitor's selection and sampling options
                documented |= {o for cell in re.findall(r"^\| (`-[^|]+) \|", text.split("## `tensorferry monitor`\n")[1].split("\n## ")[0], re.M)
                               for o in re.findall(r"`(--[-\w]+)`", cell)}
            offered = set(re.findall(r"^\s+(?:-\w[ \w]*, )?(--[-\w]+)", helptext, re.M)) - {"--help"}
            assert offered <= documented, f"tensorferry {verb}: undocumented {sorted(offered - documented)}"


# The packages a user imports names from; the docs' python blocks may add more.
PUBLIC_MODULES = {"tensorferry", "tensorferry.ray", "tensorferry.monitor", "tensorferry.vllm"}


def _modules_the_docs_import() -> set[str]:
    """The tensorferry modules the python blocks of README.md and docs/ import."""
    from _snippets import blocks, pages

    return {m for page in pages() for block in blocks(page)
            for m in re.findall(r"^\s*(?:from|import)\s+(tensorferry(?:\.\w+)*)", block.code, re.M)}


def _api_entries(modules: set[str]) -> set[str]:
    """``module.name`` of each public name an entry of api.md documents: a
    ``::: path.Name`` entry (its own, or in its ``members``) documents it
    for the longest of ``modules`` its path starts with, so
    ``tensorferry.vllm._infos.TensorferryInitInfo`` is ``tensorferry.vllm``'s."""

    def owner(path: str) -> str:
        return max((m for m in modules if path == m or path.startswith(m + ".")), key=len, default="")

    documented = set()
    for entry in re.split(r"^::: ", (REF / "api.md").read_text(), flags=re.M)[1:]:
        path, *rest = entry.split("\n")
        options = "\n".join(itertools.takewhile(lambda line: line.startswith("    "), rest))
        parent, _, name = path.rpartition(".")
        documented.add(f"{owner(parent)}.{name}")
        for members in re.findall(r"members: \[([^\]]*)\]", options):
            documented |= {f"{owner(path)}.{m.strip()}" for m in members.split(",")}
    return documented


def test_every_public_name_is_in_the_api_reference() -> None:
    """Each name in the public modules' ``__all__`` (those above and every
    one the docs import from) has a ``:::`` entry (or is in a listed
    ``members``) on docs/reference/api.md, under that module."""
    import importlib

    modules = PUBLIC_MODULES | _modules_the_docs_import()
    documented = _api_entries(modules)
    assert "tensorferry.errors" in documented  # the errors module, whole
    errors = {n for n in tf.__all__ if n.endswith(("Error", "Process", "Denied"))}
    assert errors <= set(tensorferry.errors.__all__)
    # Not entries of their own: the version string, the errors (their module
    # is listed whole), the Ray transport's name.
    unlisted = {f"tensorferry{m}.{n}" for n in tensorferry.errors.__all__ for m in ("", ".errors")} \
        | {"tensorferry.__version__", "tensorferry.ray.NAME"}
    public = {f"{m}.{n}" for m in modules for n in importlib.import_module(m).__all__}
    missing = public - unlisted - documented
    assert not missing, f"not in docs/reference/api.md: {sorted(missing)}"
