"""How long a small message between two local gloo ranks takes while both ranks compute (issue 16).

A figure, not a test. Two processes on this host, one torch thread each as the ranks of
``adaptis run``, exchange a small tensor (one microbatch's activations of the shipped example
are a few KB) ``--exchanges`` times, spinning ``--compute-ms`` of busy work between exchanges as
a pipeline computes between its messages. Each way of exchanging is timed in turn
(A B C ... A B C ...), and the report gives per way the mean, median, 90th percentile and
maximum of one exchange and how many took over 2 ms: on a host with as many cores as ranks,
gloo's own threads must take a core from a computing rank, so a few exchanges wait milliseconds
and the mean, which a step pays, sits far above the median.

Ways: ``pingpong`` (one rank sends while the other waits, then back), ``both`` (each rank sends
and receives at once, as interleaved schedules do), ``batch`` (the same through
``batch_isend_irecv``, as torch's pipeline runtime posts its messages).

    python bench/gloo_messages.py                        # 3 ways x 400 exchanges x 3 rounds
    python bench/gloo_messages.py --compute-ms 0 --ways pingpong   # an idle host's latency
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WAYS = ("pingpong", "both", "batch")


def _exchange(way: str, *, peer: int, rank: int, out: torch.Tensor, into: torch.Tensor) -> None:
    if way == "pingpong" and rank == 0:
        dist.isend(out, peer).wait()
        dist.irecv(into, peer).wait()
    elif way == "pingpong":
        dist.irecv(into, peer).wait()
        dist.isend(out, peer).wait()
    elif way == "both":
        send, recv = dist.isend(out, peer), dist.irecv(into, peer)
        recv.wait()
        send.wait()
    else:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]):
            work.wait()


def _rank(rank: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out, into = torch.zeros(args["elements"]), torch.zeros(args["elements"])
    times: dict[str, list[float]] = {w: [] for w in args["ways"]}
    for _round in range(args["rounds"]):
        for way in args["ways"]:  # taking turns: a slow minute of the host hits every way alike
            for i in range(args["exchanges"] + 20):
                started = time.perf_counter()
                _exchange(way, peer=1 - rank, rank=rank, out=out, into=into)
                if i >= 20:  # the first exchanges set up gloo's pairs
                    times[way].append(time.perf_counter() - started)
                until = time.perf_counter() + args["compute_ms"] * 1e-3
                while time.perf_counter() < until:  # a rank computing: it holds its core
                    pass
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--exchanges", type=int, default=400, help="timed exchanges per way and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compute-ms", type=float, default=0.3, help="busy work between two exchanges")
    p.add_argument("--elements", type=int, default=2 * 64 * 64, help="float32 elements a message")
    args = p.parse_args()
    ways = args.ways.split(",")
    if unknown := [w for w in ways if w not in WAYS]:
        raise SystemExit(f"unknown way(s) {', '.join(unknown)}: use {', '.join(WAYS)}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    load = os.getloadavg()[0]
    mp.start_processes(_rank, args=(port, {"ways": ways, "exchanges": args.exchanges, "rounds": args.rounds,
                                           "compute_ms": args.compute_ms, "elements": args.elements}, results),
                       nprocs=2, start_method="spawn")
    times = results.get()
    print(f"# gloo exchanges of {4 * args.elements} B between 2 local ranks, {args.compute_ms} ms of compute "
          f"between them; {os.cpu_count()} cores, load {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("| way | exchanges | mean ms | median ms | p90 ms | max ms | over 2 ms |")
    print("|---|---|---|---|---|---|---|")
    for way in ways:
        ts = sorted(times[way])
        print(f"| {way} | {len(ts)} | {1e3 * statistics.fmean(ts):.3f} | {1e3 * statistics.median(ts):.3f} | "
              f"{1e3 * ts[int(0.9 * len(ts))]:.3f} | {1e3 * ts[-1]:.2f} | {sum(t > 2e-3 for t in ts)} |")


if __name__ == "__main__":
    main()
