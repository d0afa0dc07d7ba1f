"""``/metrics`` text at node scale: the bytes prometheus_client would write, ~6x faster.

With ``--per-process`` a scrape of 1,000 processes holds ~7,000 series, and
prometheus_client formats each one alone (it checks and escapes every label
name and value of every sample): ~80 ms a scrape on a loaded 2-core machine.
The monitor's families are few and plain (gauges, counters, summaries;
legacy-valid names; no exemplars, timestamps or units), so this writes the
two formats a scraper negotiates (the Prometheus text format 0.0.4 and
OpenMetrics 1.x) itself, and keeps each label set's rendered text between
scrapes: a node's processes keep their names and pids. Anything else it
is asked for (another format or escaping, a ``name[]`` filter, a family it
does not know) is left to prometheus_client. The output is byte for byte
what prometheus_client writes (tested).
"""

from __future__ import annotations

__all__ = ["Exposition", "fast_format"]

import functools
import re
from collections.abc import Iterable
from typing import Literal

from prometheus_client import exposition
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

Format = Literal["text", "openmetrics"]

# prometheus_client's legacy-name rules (validation.py): names and label names
# that pass them are written as they are under every escaping scheme.
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^(?!__)[a-zA-Z_][a-zA-Z0-9_]*$")
# The escapings under which a legacy-valid name is written unchanged (the
# names prometheus_client 0.21+ gives them; older ones have no escaping).
_UNDERSCORES = getattr(om_exposition, "UNDERSCORES", "underscores")
_PLAIN_ESCAPINGS = (_UNDERSCORES, getattr(om_exposition, "ALLOWUTF8", "allow-utf-8"))
# Samples prometheus_client's text format moves into gauges of their own.
_OM_ONLY_SUFFIXES = ("_created", "_gsum", "_gcount")
# Label sets kept rendered; a node has far fewer (processes x kinds), and
# past this many the cache starts over.
_MAX_CACHED_LABEL_SETS = 1 << 18


def fast_format(encoder: object) -> Format | None:
    """Which format prometheus_client's ``choose_encoder`` picked, if this module writes it."""
    if encoder is exposition.generate_latest:
        return "text"
    if encoder is om_exposition.generate_latest:
        return "openmetrics"
    if isinstance(encoder, functools.partial) and encoder.func is om_exposition.generate_latest and not encoder.args:
        kw = encoder.keywords
        version = str(kw.get("version", "1.0.0"))
        if kw.get("escaping", _UNDERSCORES) in _PLAIN_ESCAPINGS and version.split(".")[0] == "1":
            return "openmetrics"
    return None


def _escape_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class Exposition:
    """Writes a registry's families as ``/metrics`` text; one per server (it keeps label text between scrapes)."""

    def __init__(self) -> None:
        # (label names, label values) -> '{a="x",b="y"}' with names sorted, as prometheus_client writes them.
        self._labels: dict[tuple[tuple[str, ...], tuple[str, ...]], str] = {}
        # Sample names already checked, per format (the text format moves _created samples).
        self._names: dict[Format, set[str]] = {"text": set(), "openmetrics": set()}

    def _label_text(self, labels: dict[str, str]) -> str | None:
        key = (tuple(labels), tuple(labels.values()))
        text = self._labels.get(key)
        if text is None:
            if not all(_LABEL.match(k) for k in labels):
                return None
            if len(self._labels) >= _MAX_CACHED_LABEL_SETS:
                self._labels.clear()
            inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
            text = self._labels[key] = "{" + inner + "}" if inner else ""
        return text

    def render(self, registry: Collector, fmt: Format) -> bytes | None:
        """The registry's families in ``fmt``; None where one of them is not
        plain enough for this writer (then prometheus_client writes them all)."""
        out: list[str] = []
        append = out.append
        label_text, names = self._label_text, self._names[fmt]
        for metric in registry.collect():
            name, mtype, doc = metric.name, metric.type, metric.documentation
            if not _NAME.match(name) or getattr(metric, "unit", "") or mtype not in ("gauge", "counter", "summary"):
                return None
            if fmt == "text":
                shown = name + "_total" if mtype == "counter" else name
                help_ = doc.replace("\\", r"\\").replace("\n", r"\n")
            else:
                shown, help_ = name, _escape_value(doc)
            append(f"# HELP {shown} {help_}\n# TYPE {shown} {mtype}\n")
            samples: Iterable[Sample] = metric.samples
            for s in samples:
                if s.timestamp is not None or s.exemplar is not None or getattr(s, "native_histogram", None):
                    return None
                sname = s.name
                if sname not in names:
                    # _created and the like: the text format moves them into gauges of their own.
                    if not _NAME.match(sname) or (fmt == "text" and any(sname == name + x for x in _OM_ONLY_SUFFIXES)):
                        return None
                    names.add(sname)
                labels = label_text(s.labels) if s.labels else ""
                if labels is None:
                    return None
                append(f"{sname}{labels} {floatToGoString(s.value)}\n")
        if fmt == "openmetrics":
            append("# EOF\n")
        return "".join(out).encode("utf-8")
