"""What the benchmarks share: peak RSS, medians and interleaving, the
environment record, the peers' limits, and where results go.

Imported by the ``bench_*.py`` scripts, which run with this folder on
``sys.path``. Nothing here imports tensorferry's private modules: the
benchmarks run against any tree whose ``src`` is on ``PYTHONPATH``
(``interleave.py`` alternates two), so they use the public API only.

Every benchmark writes one JSON document with a flat ``"ratios"`` mapping
(name -> ratio measured against the peer or the limit of the same run,
medians); ``interleave.py`` tabulates those.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = [
    "MIB", "GIB", "RESULTS", "SOCK_BUF_NBYTES", "results_dir", "write_json", "write_result", "log", "med", "rotated",
    "interleaved", "package_version", "environment", "status_nbytes", "reset_peak_rss", "peak_rss",
    "minor_faults", "check_peak_reset", "RssSampler", "peak_rss_growth", "memcpy_seconds", "tune", "recv_exact", "raw_nixl_limit",
    "copy_threads", "available_transports",
]

MIB = 1 << 20
GIB = 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"
# interleave.py points every run at a folder of its own through this.
OUT_ENV = "TENSORFERRY_BENCH_OUT"
# tensorferry's tcp transport sets its sockets' buffers to 4 MiB (large
# buffers keep a 2-core machine's loopback near memory speed); the raw TCP
# limit uses the same tuning, written here so that it stays the yardstick
# whatever the library's modules are called.
SOCK_BUF_NBYTES = 4 << 20
# What tensorferry splits a large host copy over when TENSORFERRY_COPY_THREADS
# is unset: up to 4 threads, one per core.
_MAX_COPY_THREADS = 4


# -- results ---------------------------------------------------------------------------


def results_dir(default: Path | None = None) -> Path:
    """The folder results go to: ``$TENSORFERRY_BENCH_OUT`` if set (interleave.py), else ``default`` or RESULTS."""
    env = os.environ.get(OUT_ENV)
    return Path(env) if env else (default or RESULTS)


def write_json(path: Path, doc: dict, *, indent: int = 1, default: Callable[[Any], Any] = float) -> Path:
    """Write ``doc`` as JSON to ``path`` (its folder made if missing);
    ``default`` turns what JSON lacks (numpy scalars, paths) into what it has."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=default))
    return path


def write_result(path: Path, doc: dict, ratios: dict[str, float | None], *,
                 default: Callable[[Any], Any] = float) -> Path:
    """Write ``doc`` as JSON with its flat ``ratios`` (None where not measured)."""
    doc["ratios"] = {k: (None if v is None else float(v)) for k, v in ratios.items()}
    return write_json(path, doc, default=default)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- medians and interleaving --------------------------------------------------------


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def rotated(n: int, r: int) -> list[int]:
    """``0 .. n-1`` starting at ``r % n``: round ``r``'s order of ``n``
    variants, so that none always runs first (or right after another)."""
    return [(r + i) % n for i in range(n)]


def interleaved(count: int, warmups: int, repeats: int, run: Callable[[int, int], dict]) -> list[dict]:
    """Run ``count`` variants in rounds: each round runs every variant once,
    in an order rotated every round, so load that drifts over seconds
    weighs on all of them alike.

    ``run(i, round)`` does variant ``i``'s step and returns its record.
    Returns, per variant, ``{"first": round 0's record, "warmup": [records
    of the warm-up rounds], "records": [the timed ones]}`` (the first round is
    a warm-up; where a plan is made in it, it is reported apart).
    """
    out: list[dict] = [{"first": {}, "warmup": [], "records": []} for _ in range(count)]
    for r in range(warmups + repeats):
        for i in rotated(count, r):
            rec = run(i, r)
            if r == 0:
                out[i]["first"] = rec
            (out[i]["warmup"] if r < warmups else out[i]["records"]).append(rec)
    return out


# -- the environment record ----------------------------------------------------------


def package_version(name: str) -> str:
    """The installed version of distribution ``name``, or ``"absent"``."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def environment(**extra: Any) -> dict:
    """What a result was measured on: machine, load, software, and which
    tensorferry tree was imported (interleave.py compares two)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ncpu = len(os.sched_getaffinity(0))
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    try:
        import tensorferry

        tf_file = str(Path(tensorferry.__file__).resolve().parent)
    except ImportError:
        tf_file = "absent"
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{cpu}, {ncpu} cores, {mem_gib:.0f} GiB, Linux {platform.release()}",
        "cpus": ncpu,
        "loadavg_1min": round(os.getloadavg()[0], 2),
        "python": sys.version.split()[0],
        "torch": package_version("torch"),
        "numpy": package_version("numpy"),
        "ray": package_version("ray"),
        "nixl": package_version("nixl"),
        "tensorferry": package_version("tensorferry"),
        "tensorferry_imported_from": tf_file,
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
        "TENSORFERRY_COPY_THREADS": os.environ.get("TENSORFERRY_COPY_THREADS"),
    }
    env.update(extra)
    return env


# -- peak RSS (one implementation for every benchmark) -------------------------------


def status_nbytes(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (VmRSS, VmHWM), in bytes."""
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f:
            if line.startswith(field.encode() + b":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> int:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: write
    ``5`` to clear_refs); returns that baseline in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_nbytes("VmRSS")


def peak_rss(pid: int | str = "self") -> int | None:
    """Peak resident set (VmHWM) of this or another local process; None if it is gone."""
    try:
        return status_nbytes("VmHWM", pid)
    except (OSError, KeyError):
        return None


def minor_faults() -> int:
    """Page faults of this process so far (fresh memory costs one per 4 KiB page)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def check_peak_reset(nbytes: int = 64 * MIB) -> bool:
    """Prove the reset and the read-out see a short-lived touched allocation
    of ``nbytes`` (and forget it after the next reset)."""
    base = reset_peak_rss()
    block = b"\x01" * nbytes  # written: every page touched
    high = status_nbytes("VmHWM")
    del block
    base = reset_peak_rss()
    after = status_nbytes("VmHWM")
    return high - base > nbytes * 3 // 4 and after - base < nbytes // 4


class RssSampler(threading.Thread):
    """Samples RSS from /proc/self/statm every ~0.2 ms: a cross-check of VmHWM.

    torch's copy kernels release the GIL, so the sampler runs during copies;
    it can miss a peak inside pure-Python stretches (VmHWM cannot).
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.max_bytes = 0
        self.samples = 0
        self._stop_event = threading.Event()
        self._fd = os.open("/proc/self/statm", os.O_RDONLY)

    def rss_bytes(self) -> int:
        return int(os.pread(self._fd, 128, 0).split()[1]) * self.page

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.max_bytes = max(self.max_bytes, self.rss_bytes())
            self.samples += 1
            time.sleep(0.0002)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        os.close(self._fd)


def peak_rss_growth(fn: Callable[[], Any], nbytes: int) -> dict[str, Any]:
    """RSS growth (peak by VmHWM, cross-checked by sampling, and retained)
    during one call of ``fn`` beyond what was resident; ``nbytes``: the bytes
    the call handles (``packed_nbytes``), for the growth in percent. The
    call's result is under ``"_out"``."""
    import gc

    gc.collect()
    sampler = RssSampler()
    sampler.start()
    time.sleep(0.005)
    rss0 = reset_peak_rss()
    out = fn()
    hwm = status_nbytes("VmHWM")
    rss1 = status_nbytes("VmRSS")
    sampler.stop()
    peak = hwm - rss0
    return {
        "packed_nbytes": nbytes,
        "peak_growth_nbytes": peak,
        "peak_growth_pct": 100.0 * peak / nbytes,
        "retained_growth_nbytes": rss1 - rss0,
        "sampled_peak_growth_nbytes": sampler.max_bytes - rss0,
        "sampler_samples": sampler.samples,
        "_out": out,
    }


# -- the peers' limits ---------------------------------------------------------------


def copy_threads() -> int:
    """The threads tensorferry splits a large host copy over: what
    ``TENSORFERRY_COPY_THREADS`` says, else one per core up to 4."""
    raw = os.environ.get("TENSORFERRY_COPY_THREADS", "").strip()
    if raw.isdigit() and int(raw) >= 1:
        return int(raw)
    return max(1, min(_MAX_COPY_THREADS, len(os.sched_getaffinity(0))))


def memcpy_seconds(src: Any, warmup: int, repeats: int, *, libc: bool = True, threads: int = 1) -> dict:
    """The copy limit: ``src``'s bytes (a contiguous torch tensor) copied
    into touched memory, timed; ``libc`` with numpy's copyto (one libc
    memcpy, GIL released; what tensorferry copies with), else torch's
    ``copy_`` of uint8; with ``threads`` > 1, in as many equal slices on as
    many threads at once (the machine's copy bandwidth). Checked after."""
    import numpy as np
    import torch

    s = src.reshape(-1).view(torch.uint8)
    nbytes = s.numel()
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.fill_(0)
    pool = None
    if libc and threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads)
        d, sn = dst.numpy(), s.numpy()
        cuts = [nbytes * i // threads for i in range(threads + 1)]
        slices = [(d[a:b], sn[a:b]) for a, b in zip(cuts, cuts[1:])]

        def copy() -> None:
            for f in [pool.submit(np.copyto, dd, ss, casting="no") for dd, ss in slices]:
                f.result()
        via = f"np.copyto (libc memcpy) in {threads} slices on {threads} threads"
    elif libc:
        d, sn = dst.numpy(), s.numpy()
        copy = lambda: np.copyto(d, sn, casting="no")  # noqa: E731
        via = "np.copyto (libc memcpy)"
    else:
        copy = lambda: dst.copy_(s)  # noqa: E731
        via = "torch copy_ of uint8"
    times = []
    for _ in range(warmup + repeats):
        t = time.monotonic()
        copy()
        times.append(time.monotonic() - t)
    if pool is not None:
        pool.shutdown()
    return {"seconds": times[warmup:], "verified": bool(torch.equal(dst, s)), "via": via, "threads": threads,
            "nbytes": nbytes}


def tune(sock: socket.socket) -> None:
    """The one socket tuning of the raw TCP limit and the socket peers:
    what tensorferry's tcp transport does to its sockets."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF_NBYTES)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def raw_nixl_limit(nbytes: int, repeats: int, *, many_descs: int = 0) -> dict | None:
    """The raw-NIXL limit (``_raw_nixl.py``: one READ of ``nbytes`` between
    two fresh processes, checked byte for byte there); with ``many_descs``,
    the same bytes as that many descriptors too (context). None without nixl."""
    import importlib.util

    if importlib.util.find_spec("nixl") is None:
        return None
    import _raw_nixl

    counts = [1] + ([many_descs] if many_descs else [])
    table = _raw_nixl.raw_nixl_read_table(nbytes, counts, repeats)
    out = {"seconds": table[1], "verified": True, "via": "benchmarks/_raw_nixl.py (UCX, error handling 'peer', CMA)"}
    if many_descs:
        out[f"seconds_{many_descs}_descs"] = table[many_descs]
    return out


def available_transports() -> list[str]:
    """The transports this machine runs: shm (Linux), tcp, and nixl where
    its package is installed (asked through the public ``tensorferry.transports``
    when it answers, so a tree that moved it still runs)."""
    try:
        from tensorferry.transports import available

        return list(available())
    except (ImportError, AttributeError):
        import importlib.util

        out = (["shm"] if sys.platform.startswith("linux") else []) + ["tcp"]
        return out + (["nixl"] if importlib.util.find_spec("nixl") is not None else [])
