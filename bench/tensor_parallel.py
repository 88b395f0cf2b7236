"""Tensor parallelism: measured vs predicted on local CPU ranks, and paper-scale dry runs (issue 29).

A figure, not a test. Two parts (``--part measure``, ``--part dry``, default both):

**measure.** The tiny tensor-parallel example (examples/tiny-tensor-parallel.yaml) trained by
``adaptis run --problem`` as T=1 x P=2 (2 ranks), T=2 x P=2 (4 ranks), T=2 x P=2 with sequence
parallelism (4 ranks, ``sequenceParallel: true``) and T=2 x P=1 (2 ranks),
taking turns (A B C A B C ...) for ``--reps`` rounds. The layers are measured once
(``measure_problem``, what ``profile: measure`` does) and every configuration's problem is that
profile at its degree T, its layers marked by kind as the estimate marks them (Mamba whole, the
all-reduces per kind: adaptis.planner.tensor_parallel.mark_by_kind) and ``network.tensor`` a gloo
all-reduce over loopback measured here first. Per configuration: the measured step and the
predicted one, the prediction ``adaptis run`` makes with ``profile: measure`` (layers unmarked,
tensor link free), and the share of each rank's time inside the tensor-parallel collectives,
timed in the ranks themselves (a sitecustomize on the ranks' PYTHONPATH wraps the DTensor
collectives, torch.distributed._functional_collectives, and waits for each). Runs during which
other processes used more than ``--max-load`` cores are left out (bench/measured_speedup.py).
The CPU makes tensor parallelism look bad: its all-reduces go over loopback through gloo, the
ranks share 2 cores, and a tiny layer's split matmuls save less than the reduce costs.
Sequence parallelism adds an all-gather per MoE and Mamba block (computed whole on the gathered
sequence) and DTensor redistributions, and halves what crosses between the stages, which on
loopback costs next to nothing: on the CPU it can only look worse than plain T=2.

**dry.** A Llama-3-70B-shaped and a GPT-3-175B-shaped zoo job planned on estimated layers
(adaptis.planner.estimate.estimate_layers at an H200's bf16 rate, no torch work) on H200s
(141 GB each; an NVLink-class tensor link, an inter-node link between pipeline stages and
replicas): predicted iteration, bubble and peak memory per GPU for adaptis, i1f1b and 1f1b at
PP x TP (x DP) and, for contrast, at TP 1.

    python bench/tensor_parallel.py [--part measure|dry|both] [--reps 3] [--steps 6]
    python bench/tensor_parallel.py --part dry --scale tiny     # what tests/planner runs
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from measured_speedup import REPO, timed_run
from tensor_parallel_dry import dry_runs, dry_table

EXAMPLE = REPO / "examples" / "tiny-tensor-parallel.yaml"
#: name -> (spec.parallelism, pipeline ranks P, tensor degree T)
CONFIGS: dict[str, tuple[dict[str, Any], int, int]] = {
    "T=1 P=2": ({"workers": 2, "gpusPerWorker": 1, "tensorParallel": 1}, 2, 1),
    "T=2 P=2": ({"workers": 2, "gpusPerWorker": 2, "tensorParallel": 2}, 2, 2),
    "T=2+SP P=2": ({"workers": 2, "gpusPerWorker": 2, "tensorParallel": 2, "sequenceParallel": True}, 2, 2),
    "T=2 P=1": ({"workers": 1, "gpusPerWorker": 2, "tensorParallel": 2}, 1, 2),
}

#: Put on the ranks' PYTHONPATH: wraps the DTensor collectives, waits for each, and writes
#: this process's total seconds, calls and first/last times to $ADAPTIS_BENCH_TP_DIR at exit.
SITECUSTOMIZE = '''
import atexit, json, os, time
_out = os.environ.get("ADAPTIS_BENCH_TP_DIR")
if _out and "RANK" in os.environ:
    import torch.distributed._functional_collectives as _f
    _t = {"seconds": 0.0, "calls": 0, "first": None, "last": None}
    def _wrap(fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            if isinstance(out, _f.AsyncCollectiveTensor):
                out = out.wait()
            t1 = time.perf_counter()
            _t["seconds"] += t1 - t0; _t["calls"] += 1
            _t["first"] = t0 if _t["first"] is None else _t["first"]; _t["last"] = t1
            return out
        return timed
    for _n in ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_to_all_single"):
        if hasattr(_f, _n):
            setattr(_f, _n, _wrap(getattr(_f, _n)))
    def _dump():
        with open(os.path.join(_out, "rank-%s-%d.json" % (os.environ["RANK"], os.getpid())), "w") as fh:
            json.dump(_t, fh)
    atexit.register(_dump)
'''


def _all_reduce_rank(rank: int, port: int, sizes: list[int], out: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    medians = []
    for n in sizes:
        buf = torch.ones(max(1, n // 4))
        times = []
        for i in range(41):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            if i:
                times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    if rank == 0:
        Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def measure_tensor_link(*, output_bytes: float, tmp: Path) -> dict[str, float]:
    """A 2-rank gloo all-reduce over loopback, fitted to the planner's ring model
    (2 (T-1) latency + 2 (T-1)/T bytes / bandwidth; at T=2: 2 latency + bytes / bandwidth)."""
    import socket

    import torch.multiprocessing as mp

    from adaptis.worker.profiling.hardware import fit_link

    sizes = [256, 4096, int(output_bytes), 8 * int(output_bytes)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp / "all-reduce.json"
    mp.spawn(_all_reduce_rank, args=(port, sizes, str(out)), nprocs=2, join=True)
    t = json.loads(out.read_text())
    fit = fit_link([float(n) for n in sizes], t)  # t = a + n / bandwidth; a = 2 latency
    return {"bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s, "latency_s": fit.latency_s / 2,
            "output_bytes": output_bytes, "seconds": t[2]}


def config_problem(base: Any, *, devices: int, degree: int, link: dict[str, float] | None,
                   marked: bool, sequence: bool = False) -> Any:
    """The measured profile as one configuration's problem: P devices, degree T, the layers
    marked by kind (``marked``) and the tensor link (None: free, as ``profile: measure``)."""
    from adaptis.api.problem import Link
    from adaptis.planner.tensor_parallel import mark_by_kind

    layers = base.expanded_layers()
    if marked:
        layers = mark_by_kind(layers)
    tensor = None if link is None else Link(bandwidth_bytes_per_s=link["bandwidth_bytes_per_s"],
                                            latency_s=link["latency_s"])
    return base.model_copy(update={
        "layers": layers, "tensor_parallel": degree, "sequence_parallel": sequence,
        "devices": base.devices.model_copy(update={"count": devices, "per_node": devices}),
        "network": base.network.model_copy(update={"tensor": tensor})})


def predicted_step(problem: Any, *, ranks: int) -> float:
    """The step ``adaptis run`` predicts for ``problem`` on ``ranks`` local one-thread ranks."""
    from adaptis.api.plan import predicted_seconds
    from adaptis.cli.run import _shared_cores
    from adaptis.planner.strategies import plan_strategy
    from adaptis.worker.profiling.contention import usable_cores

    shared = _shared_cores(problem, threads=ranks, cores=usable_cores())
    outcome = plan_strategy(shared, "adaptis")
    if outcome.plan is None:
        raise SystemExit(f"no plan: {outcome.result.reason}")
    return float(predicted_seconds(outcome.plan.predicted)["step_seconds"])


def collective_share(directory: Path) -> tuple[float, int, float] | None:
    """Mean over the ranks of (seconds in TP collectives) / (first to last collective), the
    calls per rank and the mean seconds of one call; None when no rank wrote (T=1: no DTensor
    collective)."""
    rows = [json.loads(p.read_text()) for p in directory.glob("rank-*.json")]
    rows = [r for r in rows if r["calls"] and r["last"] > r["first"]]
    if not rows:
        return None
    return (statistics.mean(r["seconds"] / (r["last"] - r["first"]) for r in rows),
            round(statistics.mean(r["calls"] for r in rows)),
            sum(r["seconds"] for r in rows) / sum(r["calls"] for r in rows))


def measure(args: argparse.Namespace) -> list[str]:
    from adaptis.api.job import load_job
    from adaptis.worker.profiling.hardware import configure_host
    from adaptis.worker.profiling.job_problem import measure_problem

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="adaptis-tp-") as tmp_s:
        tmp = Path(tmp_s)
        base_doc = yaml.safe_load(EXAMPLE.read_text())
        base_doc["spec"]["training"]["steps"] = args.steps
        configure_host(threads=1)  # profiled as the ranks run: one torch thread each
        base = measure_problem(load_job(EXAMPLE).spec, devices=2)
        out_bytes = max(lay.output_bytes for lay in base.expanded_layers() if lay.kind == "attention")
        link = measure_tensor_link(output_bytes=out_bytes, tmp=tmp)
        print(f"gloo all-reduce of {out_bytes:.0f} B between 2 loopback ranks: {1e6 * link['seconds']:.0f} us "
              f"(fit: {1e6 * link['latency_s']:.0f} us latency, {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s); "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        env_path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
        plans: dict[str, tuple[Path, float]] = {}
        for name, (par_, pipeline, degree) in CONFIGS.items():
            seq = bool(par_.get("sequenceParallel"))
            marked = config_problem(base, devices=pipeline, degree=degree, link=link, marked=True, sequence=seq)
            plain = config_problem(base, devices=pipeline, degree=degree, link=None, marked=False, sequence=seq)
            path = tmp / f"{name.replace(' ', '-').replace('=', '').replace('+', '')}-problem.yaml"
            path.write_text(yaml.safe_dump(marked.model_dump(mode="json", exclude_none=True)))
            plans[name] = (path, predicted_step(plain, ranks=pipeline * degree))
        for rep in range(args.reps):
            for name, (par, _pipeline, _degree) in CONFIGS.items():
                doc = copy.deepcopy(base_doc)
                doc["spec"]["parallelism"] = dict(par)
                manifest = tmp / f"{name.replace(' ', '-').replace('=', '').replace('+', '')}.yaml"
                manifest.write_text(yaml.safe_dump(doc))
                coll = tmp / f"coll-{rep}-{name.replace(' ', '-').replace('=', '').replace('+', '')}"
                coll.mkdir()
                os.environ.update(ADAPTIS_BENCH_TP_DIR=str(coll), PYTHONPATH=env_path)
                summary, row = timed_run(manifest, problem=plans[name][0], steps=args.steps, workdir=tmp / "w")
                if summary is not None:
                    row.update(step=summary["measured_step_seconds"], predicted=summary["predicted_step_seconds"],
                               share=collective_share(coll))
                rows[name].append(row)
                shown = (f"step {1e3 * row['step']:.0f} ms (predicted {1e3 * row['predicted']:.0f}, "
                         f"as profile: measure {1e3 * plans[name][1]:.0f})" if "step" in row else row["error"])
                share = row.get("share")
                if share:
                    shown += (f", {100 * share[0]:.0f} % in TP collectives ({share[1]} calls a rank, "
                              f"{1e6 * share[2]:.0f} us a call)")
                print(f"round {rep} {name} {shown}; others {row['others_cores']:.2f} cores, "
                      f"load {row['load_before']:.2f}->{row['load_after']:.2f}", flush=True)
    lines = ["| configuration | ranks | measured step ms | predicted ms (marked, gloo link) | error | "
             "predicted ms (as profile: measure) | error | time in TP collectives | us a collective "
             f"(idle: {1e6 * link['seconds']:.0f}) | clean runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, mine in rows.items():
        _par, pipeline, degree = CONFIGS[name]
        ok = [r for r in mine if "step" in r and r["others_cores"] <= args.max_load]
        busy = ""
        if len(ok) < 2:  # the figures of every run, marked: the machine was too busy to trust them
            ok = [r for r in mine if "step" in r]
            busy = f" (too busy: others used {statistics.median(r['others_cores'] for r in mine):.2f} cores)"
        if not ok:
            why = "; ".join(r["error"] for r in mine if "error" in r)
            lines.append(f"| {name} | {pipeline * degree} | {why} | | | | | | | 0 of {len(mine)} |")
            continue
        med = statistics.median(r["step"] for r in ok)
        pred = statistics.median(r["predicted"] for r in ok)
        plain = plans[name][1]
        shares = [r["share"][0] for r in ok if r.get("share")]
        share = f"{100 * statistics.median(shares):.0f} %" if shares else "none (T=1)"
        calls = [r["share"][2] for r in ok if r.get("share")]
        per_call = f"{1e6 * statistics.median(calls):.0f}" if calls else ""
        lines.append(f"| {name} | {pipeline * degree} | {1e3 * med:.0f} | {1e3 * pred:.0f} | "
                     f"{100 * (pred - med) / med:+.0f} % | {1e3 * plain:.0f} | {100 * (plain - med) / med:+.0f} % | "
                     f"{share} | {per_call} | {0 if busy else len(ok)} of {len(mine)}{busy} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("measure", "dry", "both"), default="both")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps a run; the first is dropped")
    p.add_argument("--max-load", type=float, default=0.25)
    p.add_argument("--scale", choices=("paper", "tiny"), default="paper", help="the dry runs' shapes")
    args = p.parse_args(argv)
    print(f"# tensor parallel: {' '.join(argv if argv is not None else sys.argv[1:]) or 'defaults'}; "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", flush=True)
    if args.part in ("measure", "both"):
        print("\n".join(["", *measure(args)]), flush=True)
    if args.part in ("dry", "both"):
        print("\n".join(["", *dry_table(dry_runs(scale=args.scale))]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
