"""A small, strict wrapper over one NIXL agent: register once, READ many ranges.

The ``nixl`` transport uses one :class:`NixlEndpoint` per process side:

* the sender registers its pool's buffer once (:meth:`NixlEndpoint.register`)
  and hands :meth:`NixlEndpoint.metadata` to each receiver over the control
  channel (with the pool's base address, so both sides speak absolute
  addresses);
* the receiver registers its receive pool once, loads the sender's metadata
  (:meth:`NixlEndpoint.add_remote`) and pulls blocks with one-sided READs
  (:meth:`NixlEndpoint.read`), one descriptor per ``(address, nbytes)`` range.

What NIXL does not do for us, and this module does:

* **bounds**: every range is checked against the registered regions of both
  sides before NIXL sees it, so a wrong range fails with the numbers instead
  of NIXL's bare ``NIXL_ERR_NOT_FOUND``. To check the remote side we need
  the peer's regions, so :meth:`~NixlEndpoint.metadata` wraps NIXL's opaque
  agent metadata in a small versioned, bounded envelope that lists them
  (plain data, never pickle);
* **timeouts**: NIXL has no blocking wait; :meth:`~NixlEndpoint.read` polls
  until a deadline and cancels (releases) the request when it passes;
* **errors**: NIXL's binding exceptions become tensorferry errors
  (:class:`~tensorferry.errors.PeerGoneError` for a dead peer, else
  :class:`~tensorferry.errors.TransferError`), chained ``from`` the original;
* **merging**: adjacent ranges (adjacent on both sides, inside one region) go
  out as one descriptor; per-descriptor cost dominates with many small ranges.

Progress: NIXL's own progress thread is off, because NIXL's Python API runs
it with a zero delay (about 70% of a core even when idle). The reading side
makes progress while it polls in :meth:`~NixlEndpoint.read`. The serving
side must make progress too: with UCX's ``peer`` error handling the first
READ from a peer waits for the server to answer the connection handshake,
and when UCX emulates READ in software (TCP) every byte needs it. Once
connected on one host, UCX reads the peer's memory directly with CMA
(``process_vm_readv``), which needs nothing from the peer, not even that it
runs. So every endpoint polls in a background thread every millisecond by
default (about 2% of a core); pass ``progress_interval_seconds=None`` to
turn it off and call :meth:`~NixlEndpoint.progress` from your own loop.

Fencing: deregistering or closing does not stop a peer that already loaded
our metadata from reading over CMA: it reads our process's memory by
address, with no key the kernel checks. The transport's leases (a block is
reused only after every reader released it) are what protect memory, not
NIXL registration. A peer's death is detected (PeerGoneError).

Importing this module does not import NIXL; the first endpoint does,
through :mod:`._nixl_load` (which UCX modules may load, so that the process
exits cleanly on hosts with rdma-core). The
READs (blocking, posted, pipelined) are in :mod:`._nixl_reads`, the
metadata envelope, range checks and NIXL's errors in :mod:`._nixl_wire`.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..errors import (
    BackendUnavailableError,
    ConfigurationError,
    ProtocolError,
    TensorferryError,
    TransferError,
)
from ._nixl_load import import_nixl, warn_on_second_libnl
from ._nixl_reads import PendingRead, ReadPipeline, _Reads
from ._nixl_wire import (
    _MAX_NAME_NBYTES,
    Region,
    Regions,
    _translate,
    decode,
    encode,
    nixl_errors,
)

if TYPE_CHECKING:
    import torch

__all__ = ["NixlEndpoint", "PendingRead", "ReadPipeline", "Region"]

log = logging.getLogger("tensorferry.transports.nixl")


# Background progress: 1 ms answers a peer's connection handshake at once
# and costs ~2% of a core; 0.2 ms costs ~8% for no gain on CMA.
_PROGRESS_INTERVAL_SECONDS = 0.001


class _Registration(NamedTuple):
    region: Region
    reg_descs: Any  # NIXL's nixlRegDList, handed back to deregister_memory
    tensor: "torch.Tensor"  # keeps the memory alive while NIXL may touch it


class NixlEndpoint(_Reads):
    """One NIXL agent: registered local memory, known peers, blocking READs.

    Thread-safe: one lock serializes every call into the agent (NIXL's agent
    is created without its own locking), so concurrent :meth:`read` calls on
    one endpoint run one after another, each within its own timeout. Use one
    endpoint per thread for parallel transfers. :meth:`close` from another
    thread waits for an in-flight read to end (at most its timeout).

    Args:
        name: agent name, unique among the agents that talk to each other
            (e.g. ``f"tensorferry-{pid}-{random}"``); at most 256 UTF-8 bytes.
        backend: the NIXL backend plugin to create (``"UCX"``).
        error_handling: UCX's ``ucx_error_handling_mode``. ``"peer"`` detects
            a dead peer (a read raises :class:`PeerGoneError` within ~0.2 s);
            with ``"none"`` a read from a peer that died mid-transfer over
            TCP waits for its whole timeout. On one host both use CMA.
            Ignored by backends other than UCX.
        backend_params: extra backend init parameters (strings, as NIXL
            takes them), e.g. ``{"ucx_devices": "mlx5_0:1"}``.
        progress_interval_seconds: a daemon thread calls :meth:`progress`
            this often until :meth:`close`. A serving endpoint needs it (or
            its own calls to :meth:`progress`): without, a peer's first read
            waits for the connection handshake until its timeout. ``None``:
            no thread (a reader that serves nobody saves ~2% of a core).

    Raises:
        BackendUnavailableError: NIXL is not installed, or has no such
            backend, or the backend cannot start.
        ValueError: a bad name or interval.
    """

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        error_handling: Literal["peer", "none"] = "peer",
        backend_params: Mapping[str, str] | None = None,
        progress_interval_seconds: float | None = _PROGRESS_INTERVAL_SECONDS,
    ) -> None:
        if not isinstance(name, str) or not 0 < len(name.encode()) <= _MAX_NAME_NBYTES:
            raise ConfigurationError(f"agent name must be a non-empty str of at most {_MAX_NAME_NBYTES} UTF-8 bytes; got {name!r}")
        if error_handling not in ("peer", "none"):
            raise ConfigurationError(f"error_handling must be 'peer' or 'none'; got {error_handling!r}")
        if progress_interval_seconds is not None and not (0 < progress_interval_seconds < math.inf):
            raise ConfigurationError(f"progress_interval_seconds must be a positive number of seconds; got {progress_interval_seconds!r}")
        self.name = name
        self.backend = backend
        self._lock = threading.RLock()
        self._closed = False
        self._registrations: dict[tuple[int, int], _Registration] = {}
        self._local = Regions([])
        self._peers: dict[str, Regions] = {}
        # Requests NIXL refused to release (cancel) after a timeout: kept
        # alive here and retried on close, never garbage-collected mid-flight.
        self._abandoned: list[Any] = []

        api = import_nixl()
        params = dict(backend_params or {})
        if backend == "UCX":
            params.setdefault("ucx_error_handling_mode", error_handling)
        try:
            # backends=[]: nixl_agent only warns about a missing plugin and
            # goes on without it; creating the backend ourselves lets us fail.
            self._agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
            plugins = self._agent.get_plugin_list()
            if backend not in plugins:
                raise BackendUnavailableError(f"NIXL has no {backend!r} backend plugin; it has: {', '.join(plugins) or 'none'}")
            self._agent.create_backend(backend, params)
            warn_on_second_libnl()  # the backend has loaded UCX and its modules by now
        except BackendUnavailableError:
            raise
        except Exception as exc:
            raise BackendUnavailableError(
                f"NIXL could not start agent {name!r} with backend {backend} ({params}): {type(exc).__name__}: {exc}; "
                "set UCX_LOG_LEVEL=info for UCX's reasons (on a host without RDMA set UCX_NET_DEVICES=lo or a NIC name)"
            ) from exc

        self._progress_stop = threading.Event()
        self._progress_thread: threading.Thread | None = None
        if progress_interval_seconds is not None:
            # The thread holds only a weak reference: an endpoint nobody
            # closed is still collected, and its thread then ends.
            self._progress_thread = threading.Thread(
                target=_progress_loop,
                args=(weakref.ref(self), self._progress_stop, progress_interval_seconds),
                name=f"tensorferry-nixl-progress-{name}",
                daemon=True,
            )
            self._progress_thread.start()

    # -- local memory -------------------------------------------------------

    def register(self, tensor: "torch.Tensor") -> Region:
        """Register a tensor's bytes with NIXL, once (sender: its pool; receiver: its receive pool).

        Registration is expensive (it pins pages); register a pool buffer
        once and read into / out of it many times. Registering the same
        ``(data_ptr, nbytes)`` again does nothing. The endpoint keeps a
        reference to ``tensor`` until :meth:`deregister` or :meth:`close`, so
        the memory cannot be freed while NIXL may access it. Peers see a
        registration only in metadata taken after it.

        Args:
            tensor: a contiguous CPU or CUDA tensor (normally a 1-D uint8
                pool buffer), at least one byte.

        Returns:
            The registered region (absolute address, nbytes, memory kind, device).

        Raises:
            ValueError: not a contiguous CPU/CUDA tensor, empty, or
                overlapping (but not equal to) a registered region.
            TransferError: NIXL refused the registration; the endpoint is closed.
        """
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise ConfigurationError(f"register() takes a torch.Tensor, not {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise ConfigurationError("register() needs a contiguous tensor: call .contiguous() or register the pool's flat buffer")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ConfigurationError(f"register() takes CPU or CUDA memory; this tensor is on {tensor.device}")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ConfigurationError("register() needs at least one byte; this tensor is empty")
        mem: Literal["DRAM", "VRAM"] = "VRAM" if tensor.is_cuda else "DRAM"
        region = Region(addr, nbytes, mem, max(tensor.get_device(), 0))
        with self._lock:
            self._check_open()
            if (addr, nbytes) in self._registrations:
                return self._registrations[(addr, nbytes)].region
            for other in self._registrations.values():
                o = other.region
                if addr < o.addr + o.nbytes and o.addr < addr + nbytes:
                    raise ConfigurationError(
                        f"[{addr:#x}, +{nbytes:,}) overlaps registered region [{o.addr:#x}, +{o.nbytes:,}); "
                        "register each buffer once, whole, and read sub-ranges of it"
                    )
            def refused(exc: Exception) -> TensorferryError:
                return TransferError(
                    f"NIXL could not register {nbytes:,} bytes of {mem} at {addr:#x} ({type(exc).__name__}: {exc}); "
                    "check locked-memory limits (ulimit -l) and, for CUDA, that PYTORCH_CUDA_ALLOC_CONF has no expandable_segments"
                )

            with nixl_errors(error=refused):
                reg = self._agent.register_memory([(addr, nbytes, region.device, "")], mem)
            self._registrations[(addr, nbytes)] = _Registration(region, reg, tensor)
            self._local = Regions([r.region for r in self._registrations.values()])
            return region

    def deregister(self, tensor: "torch.Tensor") -> None:
        """Undo :meth:`register` of the same tensor bytes; unknown memory is ignored.

        Peers that loaded older metadata may still name the region: send
        them fresh metadata (they re-``add_remote`` it).

        Args:
            tensor: the tensor (or one with the same data_ptr and nbytes) registered before.

        Raises:
            TransferError: NIXL failed to deregister; the endpoint is closed.
        """
        key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        with self._lock:
            self._check_open()
            entry = self._registrations.pop(key, None)
            if entry is None:
                return
            self._local = Regions([r.region for r in self._registrations.values()])
            with nixl_errors(f"deregistering {key[1]:,} bytes at {key[0]:#x}"):
                self._agent.deregister_memory(entry.reg_descs)

    @property
    def regions(self) -> list[Region]:
        """The registered local regions, by address."""
        with self._lock:
            return list(self._local.regions)

    # -- peers ----------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata, for peers (sender side: send it over the control channel).

        Versioned, bounded plain data: the agent name, the registered regions
        (so a reader can bounds-check its ranges) and NIXL's agent metadata.
        A snapshot: take it after registering.

        Returns:
            Bytes for the peer's :meth:`add_remote`.

        Raises:
            TransferError: NIXL failed; the endpoint is closed.
        """
        with self._lock:
            self._check_open()
            with nixl_errors("getting local agent metadata"):
                nixl_md = self._agent.get_agent_metadata()
            return encode(self.name, self._local.regions, bytes(nixl_md))

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata` so this endpoint can READ its memory (receiver side).

        Loading metadata of a peer already known replaces it (e.g. after the
        peer registered more memory). Does not contact the peer.

        Args:
            metadata: bytes from the peer's :meth:`metadata`.

        Returns:
            The peer's agent name, for :meth:`read` and :meth:`remove_remote`.

        Raises:
            ProtocolError: the bytes are not a valid envelope, or NIXL cannot
                parse the agent metadata inside it.
            ValueError: the metadata is this endpoint's own.
            TransferError: NIXL refused it otherwise; the endpoint is closed.
        """
        peer, regions, nixl_md = decode(metadata)
        if peer == self.name:
            raise ConfigurationError(f"metadata names agent {peer!r}, this endpoint itself: load the peer's metadata, not our own")
        with self._lock:
            self._check_open()
            if peer in self._peers:
                # NIXL cannot update a loaded peer's descriptor lists in place
                # (its remote section may then overlap): drop, then load.
                self._invalidate(peer)
            def unloadable(exc: Exception) -> TensorferryError:
                if type(exc).__name__ == "nixlMismatchError":
                    return ProtocolError(f"NIXL cannot parse peer {peer!r}'s agent metadata ({exc}): corrupted, or another NIXL version")
                return _translate(exc, f"loading metadata of peer {peer!r}", peer)

            with nixl_errors(error=unloadable):
                loaded = self._agent.add_remote_agent(nixl_md)
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != peer:
                self._invalidate(loaded_name)
                raise ProtocolError(f"peer metadata says agent {peer!r} but its NIXL metadata is agent {loaded_name!r}")
            self._peers[peer] = Regions(regions)
            return peer

    def remove_remote(self, name: str) -> None:
        """Forget a peer and disconnect from it; unknown names are ignored.

        Args:
            name: a name :meth:`add_remote` returned.
        """
        with self._lock:
            if self._closed or self._peers.pop(name, None) is None:
                return
            self._invalidate(name)

    def _invalidate(self, name: str) -> None:
        # A dead peer may fail to disconnect cleanly; we forget it anyway.
        with nixl_errors(error=lambda exc: log.debug("NIXL failed to remove remote agent %r: %s", name, exc)):
            self._agent.remove_remote_agent(name)

    @property
    def peers(self) -> list[str]:
        """Names of the peers loaded with :meth:`add_remote`."""
        with self._lock:
            return list(self._peers)

    # -- progress and lifetime ----------------------------------------------------

    def progress(self) -> None:
        """Let NIXL make progress for peers reading from us (serving side); never blocks.

        Answers a peer's connection handshake (error handling ``peer``) and
        serves READs that UCX emulates in software (TCP); CMA and RDMA READs
        need nothing. The background thread calls it every millisecond by
        default. Skips the turn if a read holds the agent (that read's polling
        progresses it).
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            if not self._closed:
                with nixl_errors(error=lambda exc: log.debug("NIXL progress failed: %s", exc)):
                    self._agent.get_new_notifs()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Deregister all memory, forget all peers, release the agent; idempotent."""
        self._progress_stop.set()
        if self._progress_thread is not None and self._progress_thread is not threading.current_thread():
            self._progress_thread.join(timeout=5.0)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            agent = self._agent
            for handle in self._abandoned:
                try:
                    handle.release()
                except Exception as exc:
                    log.warning("NIXL still cannot release a transfer request: %s", exc)
            self._abandoned.clear()
            for name in list(self._peers):
                self._invalidate(name)
            self._peers.clear()
            for entry in self._registrations.values():
                try:
                    agent.deregister_memory(entry.reg_descs)
                except Exception as exc:
                    log.warning("NIXL failed to deregister %s: %s", entry.region, exc)
            self._registrations.clear()
            self._local = Regions([])
            # Dropping the last reference destroys the C++ agent (its UCX
            # worker and listener); handles released above hold none.
            del self._agent

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"NixlEndpoint {self.name!r} is closed; create a new one")

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def __enter__(self) -> "NixlEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._registrations)} regions, {len(self._peers)} peers"
        return f"NixlEndpoint({self.name!r}, {self.backend}, {state})"


def _progress_loop(ref: "weakref.ref[NixlEndpoint]", stop: threading.Event, interval_seconds: float) -> None:
    while not stop.wait(interval_seconds):
        endpoint = ref()
        if endpoint is None:
            return
        endpoint.progress()
        del endpoint
