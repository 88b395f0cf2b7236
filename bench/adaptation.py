"""Closed-loop adaptation on real processes (issue 17): a rank slowed mid-run, with and without it.

A figure, not a test. The shipped example (examples/tiny-heterogeneous.yaml) is profiled ONCE
(``adaptis profile``), so every run starts from the same plan; each run trains it with
``adaptis run --problem`` on local ranks while ``--slowdown`` makes one rank FACTOR times slower
from step FROM on (``ADAPTIS_SLOWDOWN``: it sleeps inside its compute, as a throttled device).
``--adaptation auto`` and ``off`` take turns (auto off auto off ...) for ``--reps`` rounds, so a
slow minute of this shared machine hurts both alike. Per run: the mean iteration over the steps
after ``--after`` (by then an auto run has re-planned and resumed), the re-plan (step, predicted
iteration of the running plan on the corrected problem vs the new plan's, layers per device,
measured restart: stop + relaunch to its first step), and the loss curve against the off run of
the same round (the resume restores weights and optimizer state, so it should be equal). Load:
the 1-minute load average and the cores the rest of the machine used meanwhile
(bench/measured_speedup.py's accounting); runs above ``--max-load`` cores are listed, not used.

    python bench/adaptation.py                 # 2 rounds, 60 steps, rank 1 4x slower from step 3
    python bench/adaptation.py --reps 1 --steps 40 --after 20   # a quick look
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml
from measured_speedup import EXAMPLE, profile, timed_run


def manifest(tmp: Path, *, window: int) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["adaptation"] = {"policy": "off", "windowSteps": window, "minGain": 0.05, "maxReplans": 1}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_once(job: Path, *, problem: Path, policy: str, slowdown: str, steps: int, after: int,
             workdir: Path) -> dict[str, Any]:
    summary, row = timed_run(job, problem=problem, steps=steps, workdir=workdir,
                             extra=("--adaptation", policy, "--slowdown", slowdown))
    row["policy"] = policy
    if summary is None:
        return row
    ad = summary["adaptation"]
    iters = ad["iteration_seconds"]
    row.update(after=statistics.mean(iters[after:]), losses=ad["losses"], segments=ad["segments"],
               history=ad["history"], decisions=ad["decisions"],
               predicted_start=ad["segments"][0]["predicted_iteration_seconds"])
    if ad["history"]:
        rec, (first, second) = ad["history"][0], ad["segments"][:2]
        row.update(replan_step=rec["step"], old_pred=rec["old_predicted_iteration_seconds"],
                   new_pred=rec["new_predicted_iteration_seconds"], speeds=rec["device_speed"],
                   layers=(first["layers_per_device"], second["layers_per_device"]),
                   restart=(first["stop_seconds"] or 0.0) + (second["launch_to_first_step_seconds"] or 0.0))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--after", type=int, default=30, help="measure the iteration over the steps after this")
    ap.add_argument("--slowdown", default="1:4@3", help="RANK:FACTOR@STEP (adaptis run --slowdown)")
    ap.add_argument("--window", type=int, default=4, help="spec.adaptation.windowSteps")
    ap.add_argument("--max-load", type=float, default=1.0, help="most cores others may use in a counted run")
    ap.add_argument("--json", type=Path, help="also write every run's row here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="adaptis-adapt-") as d:
        tmp = Path(d)
        job = manifest(tmp, window=args.window)
        problem = tmp / "problem.yaml"
        profile(job, out=problem)
        rows = []
        for rep in range(args.reps):
            for policy in ("auto", "off"):
                row = run_once(job, problem=problem, policy=policy, slowdown=args.slowdown, steps=args.steps,
                               after=args.after, workdir=tmp / f"{policy}-{rep}")
                row["rep"] = rep
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "segments")}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    print("\n".join(report(rows, args=args)))


def report(rows: list[dict[str, Any]], *, args: argparse.Namespace) -> list[str]:
    out = [f"slowdown {args.slowdown}, {args.steps} steps, iteration measured over steps > {args.after}", "",
           "| round | policy | re-plan at step | layers per device | predicted ms: start / running plan "
           "corrected -> new | measured restart s | measured iteration ms after | loss max rel. diff vs off "
           "| load | others' cores |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "after" not in r:
            out.append(f"| {r['rep']} | {r['policy']} | failed: {r.get('error')} | | | | | | | |")
            continue
        off = next((o for o in rows if o["rep"] == r["rep"] and o["policy"] == "off" and "losses" in o), None)
        # One loss per step in both (a relaunch's repeated steps are kept once), same --steps.
        diff = (max(abs(a - b) / abs(b) for a, b in zip(r["losses"], off["losses"], strict=True))
                if off is not None and r is not off else None)
        replan = r.get("replan_step", "none")
        layers = " -> ".join(map(str, r["layers"])) if "layers" in r else str(r["segments"][0]["layers_per_device"])
        pred = (f"{r['predicted_start'] * 1e3:.0f} / {r['old_pred'] * 1e3:.0f} -> {r['new_pred'] * 1e3:.0f}"
                if "old_pred" in r else f"{r['predicted_start'] * 1e3:.0f}")
        restart = f"{r['restart']:.1f}" if "restart" in r else ""
        out.append(f"| {r['rep']} | {r['policy']} | {replan} | {layers} | {pred} | {restart} | "
                   f"{r['after'] * 1e3:.0f} | {'' if diff is None else f'{diff:.1e}'} | "
                   f"{r['load_before']:.1f}-{r['load_after']:.1f} | {r['others_cores']:.2f} |")
    for policy in ("auto", "off"):
        ok = [r["after"] for r in rows if r["policy"] == policy and "after" in r and r["others_cores"] <= args.max_load]
        out.append(f"\n{policy}: median iteration after step {args.after}: "
                   + (f"{statistics.median(ok) * 1e3:.0f} ms over {len(ok)} runs" if ok else
                      f"no run with others under {args.max_load} cores"))
    return out


if __name__ == "__main__":
    main()
