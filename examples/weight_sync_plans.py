"""Weight sync with kept plans: one trainer, two workers, several steps.

    python examples/weight_sync_plans.py                # shm, 5 steps
    python examples/weight_sync_plans.py -t tcp -n 3    # over tcp

The trainer owns a model, a ``Sender`` and a kept ``SendPlan`` of the model
(``sender.plan(model)``: its tensors are inspected once). Each step it trains
in place, then ``put(plan, readers=2)`` copies the current weights into the
sender's pool and returns a ``Ticket``; the ticket's bytes
(``ticket.to_bytes()``, a few hundred bytes) go to every worker through a
pipe (in real code: your RPC, queue or Ray call). Each worker makes a
``RecvPlan`` from the first ticket (``receiver.plan(ticket, into=model)``:
the layout matched against its own model once) and hands it to every get,
which writes the bytes straight into its model's tensors.

Prints one line per step with the weights' digests on each side; ``--json``
prints them as one JSON object instead (the test reads that).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys

import torch

import tensorferry as tf

WORKERS = 2


def make_model(seed: int) -> torch.nn.Module:
    """The same architecture on both sides; the seed only sets the first weights.

    BatchNorm adds buffers (float running statistics, an int64 counter):
    several dtypes in one plan."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 8)
    )


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every tensor's name, dtype, shape and bytes, in state_dict order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def worker(index: int, transport: str, conn) -> None:
    """A worker: its own model, a Receiver, and a RecvPlan made from the first ticket."""
    torch.set_num_threads(1)  # a few processes on a few cores
    model = make_model(seed=100 + index)  # different first weights than the trainer's
    conn.send(digest(model))
    rplan = None
    with tf.Receiver(transport, timeout=60) as receiver:
        while data := conn.recv_bytes():  # b"": the trainer is done
            ticket = tf.Ticket.from_bytes(data)  # validated plain data, never unpickled
            if rplan is None:
                # Once: the ticket's layout checked against this model (a
                # LayoutMismatchError names what differs). Nothing is fetched.
                rplan = receiver.plan(ticket, into=model)
            # Every step: the bytes only, into the planned tensors. It returns
            # rplan.result, which for into=model is the model itself (for
            # into=None, the tensors the plan allocated): the same object
            # every time, updated in place.
            got = receiver.get(ticket, into=rplan)
            assert got is rplan.result is model
            conn.send(digest(model))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(16, 32)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()  # in place: the plan's tensors stay where they were


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-t", "--transport", choices=("shm", "tcp"), default="shm")
    parser.add_argument("-n", "--steps", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the digests as one JSON object")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    ctx = mp.get_context("spawn")  # fresh interpreters, as separate hosts would be
    pipes = [ctx.Pipe() for _ in range(WORKERS)]
    procs = [ctx.Process(target=worker, args=(i, args.transport, child)) for i, (_, child) in enumerate(pipes)]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    report = {"transport": args.transport, "trainer": [], "workers": [[] for _ in procs]}
    report["workers_before"] = [c.recv() for c in conns]

    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with tf.Sender(args.transport) as sender:
            plan = sender.plan(model)  # once: inspect, layout, copy runs
            for step in range(args.steps):
                train_step(model, opt)
                # readers=2: both workers get this ticket. The default,
                # readers=1, frees the weights after the first get, and the
                # second worker's get fails (a TransferError).
                ticket = sender.put(plan, readers=WORKERS)
                report["trainer"].append(digest(model))
                for c in conns:
                    c.send_bytes(ticket.to_bytes())
                # put() copied the weights into the pool (snapshot=True), so
                # the next train_step may change them at once. Waiting here
                # is for something else: every worker holds this step's
                # weights before the next one, and the pool holds one
                # version at a time. With put(plan, snapshot=False) (tcp:
                # the workers read the model's own memory) the wait is
                # required before the weights change.
                sender.wait_released(ticket, timeout=60)
                for k, c in enumerate(conns):
                    report["workers"][k].append(c.recv())
                if not args.json:
                    got = "  ".join(f"worker {k} {d[-1][:12]}" for k, d in enumerate(report["workers"]))
                    print(f"step {step}: trainer {report['trainer'][-1][:12]}  {got}")
    finally:
        for c in conns:
            c.send_bytes(b"")
        for p in procs:
            p.join(timeout=60)
    report["exit_codes"] = [p.exitcode for p in procs]
    same = all(w == report["trainer"] for w in report["workers"])
    if args.json:
        print(json.dumps(report))
    else:
        print("every worker holds the trainer's weights after every step" if same else "MISMATCH: the workers' weights differ")
    return 0 if same and report["exit_codes"] == [0] * WORKERS else 1


if __name__ == "__main__":
    sys.exit(main())
