"""vLLM workers in processes of their own, and an HTTP front that drives them.

Each worker process does what vLLM's worker does with a weight-transfer
engine: loads the general plugins (our ``vllm.general_plugins`` entry point
registers ``"tensorferry"``), initialises vLLM's parallel state (gloo,
tensor parallel over its group), builds a model of vLLM's parallel layers
(``_vllm_model.WorkerModel``) and its engine with
``WeightTransferEngineFactory.create_engine``, then runs the calls vLLM's
``Worker`` makes (``init_transfer_engine(parse_init_info(...))``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``),
each from JSON, as vLLM's HTTP routes receive them.

:class:`HttpFront` serves vLLM's weight-sync HTTP routes on loopback and
fans each call out to every worker, as vLLM's engine core does: the
trainer talks to it with vLLM's own ``HTTPVLLMWeightSyncClient``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# The worker processes' own replies come back over a local pipe (the test's
# own processes); nothing from the network is unpickled.
_READY_TIMEOUT_SECONDS = 180
_CALL_TIMEOUT_SECONDS = 120


def rendezvous_file() -> str:
    """A fresh path for a tensor-parallel group's gloo rendezvous (torch's ``file://`` init)."""
    fd, path = tempfile.mkstemp(prefix="tf-vllm-tp-")
    os.close(fd)
    os.unlink(path)
    return path


def _build(spec: Any, dtype_name: str, layerwise: bool, vcfg: Any = None) -> Any:
    import torch
    from _vllm_model import WorkerModel

    if vcfg is not None and vcfg.model_config is not None:
        # vLLM's own model class for the config, built by vLLM's loader
        # function (which records the layerwise-reload metadata)
        from vllm.model_executor.model_loader.utils import initialize_model

        return initialize_model(vllm_config=vcfg)

    model = WorkerModel(spec, getattr(torch, dtype_name))
    if layerwise:
        # What vLLM's model loader does for every model it builds: the
        # metadata its layerwise reload restores from.
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        record_metadata_for_reloading(model)
    return model


def worker_main(conn: Any, rank: int, world: int, rendezvous: str, spec: Any, dtype_name: str, layerwise: bool,
                hf_dir: str | None = None) -> None:
    """One vLLM worker process (rank ``rank`` of a tensor-parallel group of ``world``); with
    ``hf_dir`` (a Hugging Face config, no weights) vLLM's own model class for it."""
    import torch

    torch.set_num_threads(1)
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from _vllm_model import init_worker_dist

    load_general_plugins()
    transfer = WeightTransferConfig(backend="tensorferry")
    if hf_dir is None:
        vcfg = VllmConfig(weight_transfer_config=transfer)
    else:
        from vllm.config import LoadConfig, ModelConfig

        model_config = ModelConfig(model=hf_dir, tokenizer=hf_dir, skip_tokenizer_init=True, dtype=dtype_name, enforce_eager=True)
        vcfg = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"), weight_transfer_config=transfer)
    with set_current_vllm_config(vcfg):
        init_worker_dist(rank, world, rendezvous)
        model = _build(spec, dtype_name, layerwise, vcfg)
        # vLLM registers a real model's attention layers by name in its config:
        # one model of a config a process (no draft, no rebuild with hf_dir)
        draft = _build(spec, dtype_name, False) if hf_dir is None else None
        engine = WeightTransferEngineFactory.create_engine(vcfg.weight_transfer_config, vcfg, torch.device("cpu"), model)
        conn.send(("ok", type(engine).__name__))
        while True:
            op, arg = conn.recv()
            try:
                result: Any = None
                if op == "init":
                    engine.init_transfer_engine(engine.parse_init_info(json.loads(arg)))
                elif op == "start":
                    if arg == "draft":
                        engine.set_weight_update_target(draft, vcfg.model_config)
                    engine.start_weight_update()
                elif op == "update":
                    info = json.loads(arg)
                    if isinstance(info, list):  # vLLM indexes a list by the worker's global rank
                        info = info[rank]
                    engine.update_weights(info)
                elif op == "finish":
                    engine.finish_weight_update()
                    engine.reset_weight_update_target()
                elif op == "rebuild":  # a fresh model (dtype, layerwise) and engine, as a restarted vLLM would hold
                    dtype_name, layerwise = arg
                    engine.shutdown()
                    model = _build(spec, dtype_name, layerwise, vcfg)
                    engine = WeightTransferEngineFactory.create_engine(vcfg.weight_transfer_config, vcfg, torch.device("cpu"), model)
                elif op == "params":
                    target = draft if arg == "draft" else model
                    result = {n: (p.detach().clone(), p.data_ptr()) for n, p in target.named_parameters()}
                elif op == "stats":
                    result = engine.stats()
                elif op == "exit":
                    engine.shutdown()
                    conn.send(("ok", None))
                    return
                conn.send(("ok", result))
            except Exception as exc:  # noqa: BLE001 - reported to the test, which raises it
                where = "".join(traceback.format_tb(exc.__traceback__)[-3:])  # the frames that raised, for the failing test's report
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{where}"))


class WorkerError(RuntimeError):
    """A worker process reported an error (its type and message)."""


class Workers:
    """Replicas of a tensor-parallel group of vLLM workers, each rank a process."""

    def __init__(self, spec: Any, *, replicas: int = 1, tp: int = 1, dtype: str = "float32", layerwise: bool = False,
                 hf_dir: str | None = None) -> None:
        self.spec, self.tp, self.dtype, self.layerwise, self.hf_dir = spec, tp, dtype, layerwise, hf_dir
        self._ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.init_info: str | None = None
        for _ in range(replicas):
            rendezvous = rendezvous_file()
            for rank in range(tp):
                self._spawn(rank, rendezvous)
        for i in range(len(self.procs)):
            self._reply(i, _READY_TIMEOUT_SECONDS)

    def _spawn(self, rank: int, rendezvous: str, at: int | None = None) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=worker_main, args=(child, rank, self.tp, rendezvous, self.spec, self.dtype, self.layerwise, self.hf_dir),
                                  daemon=True)
        proc.start()
        if at is None:
            self.procs.append(proc)
            self.conns.append(parent)
        else:
            self.procs[at], self.conns[at] = proc, parent

    def _reply(self, i: int, timeout: float = _CALL_TIMEOUT_SECONDS) -> Any:
        if not self.conns[i].poll(timeout):
            raise WorkerError(f"worker {i} did not answer within {timeout} s")
        status, value = self.conns[i].recv()
        if status != "ok":
            raise WorkerError(f"worker {i}: {value}")
        return value

    def call(self, op: str, arg: Any = None, only: list[int] | None = None) -> list[Any]:
        """``op`` on every worker (or ``only``), all at once; their results in order."""
        which = list(range(len(self.conns))) if only is None else only
        for i in which:
            self.conns[i].send((op, arg))
        results, errors = [], []
        for i in which:  # every reply read, so a failed call leaves no stale one behind
            try:
                results.append(self._reply(i))
            except WorkerError as exc:
                errors.append(str(exc))
        if errors:
            raise WorkerError("; ".join(errors))
        return results

    def restart(self, i: int) -> None:
        """Kill worker ``i`` (a TP=1 replica) and start a fresh process in its place, with the handshake replayed."""
        assert self.tp == 1, "restart a TP=1 replica (a TP group restarts whole)"
        self.procs[i].kill()
        self.procs[i].join(30)
        self._spawn(0, rendezvous_file(), at=i)
        self._reply(i, _READY_TIMEOUT_SECONDS)
        if self.init_info is not None:
            self.call("init", self.init_info, only=[i])

    def params(self, i: int, which: str = "model") -> dict[str, Any]:
        return self.call("params", which, only=[i])[0]

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.is_alive():
                try:
                    self.conns[i].send(("exit", None))
                    self.conns[i].poll(10)
                except (OSError, BrokenPipeError):
                    pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()


class HttpFront:
    """vLLM's weight-sync HTTP routes on 127.0.0.1, each call fanned out to every worker.

    ``draft=True`` makes the next sessions target the workers' draft model
    (vLLM's ``start_draft_weight_update``).
    """

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self.draft = False
        front = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                try:
                    front.route(self.path.strip("/"), body)
                except Exception as exc:  # noqa: BLE001 - an HTTP 500 with the worker's message
                    print(f"HttpFront: /{self.path.strip('/')} failed: {exc}", file=sys.stderr)  # shown with a failing test
                    data = str(exc).encode()
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def route(self, path: str, body: Any) -> None:
        if path == "init_weight_transfer_engine":
            self.workers.init_info = json.dumps(body["init_info"])
            self.workers.call("init", self.workers.init_info)
        elif path == "start_weight_update":
            self.workers.call("start", "draft" if self.draft else None)
        elif path == "update_weights":
            self.workers.call("update", json.dumps(body["update_info"]))
        elif path == "finish_weight_update":
            self.workers.call("finish")
        else:
            raise ValueError(f"no route {path!r}")

    def client(self) -> Any:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

        return HTTPVLLMWeightSyncClient(self.url, timeout=120)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

