"""Every error a user can reach is a TensorferryError that also inherits the builtin that fits.

Two halves: a walk of the library's source that refuses a ``raise`` of a bare
builtin exception and any ``assert`` (``python -O`` strips asserts, and a
bare ``ValueError`` escapes ``except TensorferryError``); and the documented
user mistakes, each made for real and checked for its class and a message
that names the argument, the value and the numbers.
"""

from __future__ import annotations

import ast
import builtins
import math
import pickle
from pathlib import Path

import pytest
import torch

import tensorferry
from tensorferry import MemoryPool, Receiver, Sender
from tensorferry.errors import (
    BackendUnavailableError,
    ConfigurationError,
    PoolCreationError,
    TensorferryError,
)

SRC = Path(tensorferry.__file__).parent
BUILTIN_EXCEPTIONS = {
    name for name, obj in vars(builtins).items() if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _is_abstract_body(func: ast.AST) -> bool:
    """A method whose body is only (a docstring and) ``raise NotImplementedError``:
    the contract of a base class that subclasses must fill in, never reached
    through the public API (every transport implements it)."""
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return len(body) == 1 and isinstance(body[0], ast.Raise)


def _allowed(node: ast.Raise, name: str, parents: list[ast.AST], path: Path) -> bool:
    at = next((i for i in range(len(parents) - 1, -1, -1) if isinstance(parents[i], (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    func = parents[at] if at is not None else None
    owner = parents[at - 1] if at else None  # what defines the function: a class, the module
    if name == "NotImplementedError" and _is_abstract_body(func) and isinstance(owner, ast.ClassDef):
        return True
    # __getattr__ must raise AttributeError: that is how getattr(), hasattr()
    # and `from x import y` learn that a name is missing (PEP 562 for modules).
    if name == "AttributeError" and func is not None and func.name == "__getattr__":
        return True
    # `python -m tensorferry` returns its exit status this way; not an error.
    if name == "SystemExit" and path.name == "__main__.py":
        return True
    return False


def _offenders() -> list[tuple[str, int, str]]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        rel = path.relative_to(SRC).as_posix()

        def visit(node: ast.AST, parents: list[ast.AST]) -> None:
            if isinstance(node, ast.Assert):
                found.append((rel, node.lineno, lines[node.lineno - 1].strip()))
            elif isinstance(node, ast.Raise) and node.exc is not None:
                target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None
                if name in BUILTIN_EXCEPTIONS and not _allowed(node, name, parents, path):
                    found.append((rel, node.lineno, lines[node.lineno - 1].strip()))
            for child in ast.iter_child_nodes(node):
                visit(child, parents + [node])

        visit(ast.parse(source, filename=str(path)), [])
    return found


def test_the_walk_finds_what_it_must():
    """The checker itself: it flags each kind of offence and lets the justified ones pass."""
    sample = '''
def f(x):
    assert x
    raise ValueError("bare")

def g():
    raise builtins.RuntimeError

class Base:
    def todo(self):
        """Subclasses fill this in."""
        raise NotImplementedError

    def not_abstract(self, x):
        if x:
            raise NotImplementedError("half done")
        return x

def __getattr__(name):
    raise AttributeError(name)
'''
    tree = ast.parse(sample)
    flagged = []

    def visit(node, parents):
        if isinstance(node, ast.Assert):
            flagged.append(node.lineno)
        elif isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            name = target.id if isinstance(target, ast.Name) else target.attr
            if name in BUILTIN_EXCEPTIONS and not _allowed(node, name, parents, Path("x.py")):
                flagged.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, parents + [node])

    visit(tree, [])
    assert flagged == [3, 4, 7, 16]


def test_library_raises_no_bare_builtin_and_asserts_nothing():
    found = _offenders()
    bad = [f"{rel}:{line}: {text}" for rel, line, text in found]
    assert not bad, "raise a TensorferryError subclass (errors.py) instead of:\n" + "\n".join(bad)


def test_every_public_error_is_a_tensorferry_error_and_a_builtin():
    from tensorferry import errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, TensorferryError), name
        assert getattr(tensorferry, name) is cls, name
        if cls in (TensorferryError, errors.MonitorError):
            continue  # the bases themselves
        builtin_bases = [b for b in cls.__mro__ if b.__module__ == "builtins" and b not in (Exception, BaseException, object)]
        assert builtin_bases, f"{name} inherits no builtin that fits"


# -- the pool --------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [0, -16, "1024", 1.5, True, None])
def test_pool_capacity_must_be_a_positive_int(capacity):
    with pytest.raises(ConfigurationError) as info:
        MemoryPool(capacity)
    assert isinstance(info.value, ValueError)
    assert f"capacity_nbytes={capacity!r}" in str(info.value)


def test_pool_the_host_refuses_gives_the_numbers():
    # 1 PiB: more than the 128 TiB of address space a 48-bit process has, so
    # the mapping is refused on every machine.
    with pytest.raises(PoolCreationError) as info:
        MemoryPool(1 << 50)
    err = info.value
    assert isinstance(err, MemoryError) and isinstance(err.__cause__, OSError)
    assert err.capacity_nbytes == 1 << 50 and err.device == "cpu"
    msg = str(err)
    assert "1,125,899,906,842,624" in msg and "bytes of memory" in msg and "smaller capacity_nbytes" in msg
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is PoolCreationError and str(again) == msg and again.capacity_nbytes == err.capacity_nbytes


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_pool_on_cuda_without_cuda_is_backend_unavailable():
    with pytest.raises(BackendUnavailableError) as info:
        MemoryPool(1024, device="cuda")
    assert isinstance(info.value, ImportError)
    assert "device='cuda'" in str(info.value) and "device='cpu'" in str(info.value)


@pytest.mark.gpu
def test_pool_the_device_refuses_gives_the_numbers():
    with pytest.raises(PoolCreationError) as info:
        MemoryPool(1 << 50, device="cuda")
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "1,125,899,906,842,624" in str(info.value) and "bytes free" in str(info.value)
    count = torch.cuda.device_count()
    with pytest.raises(ConfigurationError, match=f"{count} CUDA device"):
        MemoryPool(1024, device=f"cuda:{count}")


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:-1x"])
def test_pool_device_must_be_cpu_or_cuda(device):
    with pytest.raises(ConfigurationError, match=f"device={device!r}"):
        MemoryPool(1024, device=device)


def test_closed_pool_says_so():
    pool = MemoryPool(1024)
    pool.close()
    with pytest.raises(ConfigurationError, match="closed"):
        pool.pack(torch.ones(3))


# -- sender and receiver ---------------------------------------------------------------


def test_receiver_unknown_transport_names_it_and_the_choices():
    with pytest.raises(ConfigurationError) as info:
        Receiver("bogus")
    msg = str(info.value)
    assert "'bogus'" in msg and "shm, tcp, nixl" in msg


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, "5"])
def test_receiver_timeout_must_be_positive_seconds(timeout):
    with pytest.raises(ConfigurationError, match="timeout"):
        Receiver("tcp", timeout=timeout)


def test_sender_unknown_transport():
    with pytest.raises(ConfigurationError, match="'bogus'"):
        Sender("bogus", capacity_nbytes=1 << 20)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_sender_wildcard_without_token(host):
    with pytest.raises(ConfigurationError) as info:
        Sender("tcp", capacity_nbytes=1 << 20, host=host)
    assert repr(host) in str(info.value) and "token=" in str(info.value)


@pytest.mark.parametrize("port", [70000, -1])
def test_sender_port_that_cannot_be_bound(port):
    with pytest.raises(ConfigurationError) as info:
        Sender("tcp", capacity_nbytes=1 << 20, port=port)
    assert f"port={port}" in str(info.value) and isinstance(info.value.__cause__, (OSError, OverflowError))


def test_sender_port_in_use():
    with Sender("tcp", capacity_nbytes=1 << 20) as first:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(ConfigurationError, match=f"port={port}") as info:
            Sender("tcp", capacity_nbytes=1 << 20, port=port)
        assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("lease", [0, -1.0, math.nan, "60"])
def test_lease_seconds_is_checked_in_sender_and_put_alike(lease):
    with pytest.raises(ConfigurationError, match=r"Sender\(lease_seconds\)"):
        Sender("tcp", capacity_nbytes=1 << 20, lease_seconds=lease)
    with Sender("tcp", capacity_nbytes=1 << 20) as sender:
        with pytest.raises(ConfigurationError, match=r"put\(lease_seconds\)"):
            sender.put(torch.ones(4), lease_seconds=lease)
        assert sender.pool.stats().used_nbytes == 0  # refused before packing


@pytest.mark.parametrize("readers", [0, -2, 1.5, True, "2"])
def test_put_readers_must_be_a_positive_int_or_none(readers):
    with Sender("tcp", capacity_nbytes=1 << 20) as sender:
        with pytest.raises(ConfigurationError, match=f"readers={readers!r}"):
            sender.put(torch.ones(4), readers=readers)
        assert sender.pool.stats().used_nbytes == 0


def test_piece_size_beyond_the_pool():
    with pytest.raises(ConfigurationError) as info:
        Sender("tcp", capacity_nbytes=1 << 20, piece_nbytes=2 << 20)
    assert "2,097,152" in str(info.value) and "1,048,576" in str(info.value)


def test_ticket_for_a_transport_not_served():
    with Sender("tcp", capacity_nbytes=1 << 20) as sender:
        ticket = sender.put(torch.ones(4), readers=None)
        with pytest.raises(ConfigurationError, match="'shm'.*serves tcp"):
            sender.ticket_for(ticket, "shm")
        sender.discard(ticket)
