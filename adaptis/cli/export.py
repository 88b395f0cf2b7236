"""``adaptis export JOB.yaml -o OUT``: a trained Hugging Face job's checkpoint as a directory
``AutoModelForCausalLM.from_pretrained(OUT)`` loads (config.json and model.safetensors).

Reads the ranks' checkpoint files of one step (``--checkpoint``: the checkpoints directory,
default the one ``adaptis run`` writes, ``.adaptis/<job>/checkpoints``; ``--step``: default the
newest step every rank wrote) and merges them with :func:`adaptis.worker.models.hf.weights.
export_checkpoint`. Only for ``spec.model.huggingface`` jobs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adaptis.api.job import load_job
from adaptis.api.model import HuggingFaceModel

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("export", help="write a Hugging Face job's checkpoint for "
                              "from_pretrained", description=__doc__.splitlines()[0])
    p.add_argument("job", metavar="JOB.yaml", help="the AdaPtisJob manifest that was trained")
    p.add_argument("-o", "--output", type=Path, required=True, help="directory to write")
    p.add_argument("--checkpoint", type=Path,
                   help="checkpoints directory (default .adaptis/<job>/checkpoints)")
    p.add_argument("--step", type=int, help="step to export (default: the newest complete one)")
    p.set_defaults(func=run)


def _step_dir(root: Path, step: int | None) -> Path:
    from adaptis.cli import CLIError

    if step is not None:
        chosen = root / f"step-{step:08d}"
        if not chosen.is_dir():
            raise CLIError(f"--step {step}: no checkpoint directory {chosen}")
        return chosen
    steps = sorted(d for d in root.glob("step-*") if d.is_dir() and d.name[5:].isdigit()
                   and not any(d.glob("rank-*.tmp*")))
    if not steps:
        raise CLIError(f"no checkpoints in {root}; train with checkpoints (spec.checkpoint."
                       "everySteps) or give --checkpoint")
    return steps[-1]


def run(args: argparse.Namespace) -> int:
    from adaptis.cli import CLIError
    from adaptis.worker.errors import WorkerError
    from adaptis.worker.state.hf_export import export_checkpoint

    job = load_job(args.job)
    model = job.spec.model
    if not isinstance(model, HuggingFaceModel):
        raise CLIError("export: spec.model.huggingface is not set; only a Hugging Face model "
                       "exports to a from_pretrained directory")
    root = args.checkpoint or Path(".adaptis") / job.metadata.name / "checkpoints"
    step_dir = _step_dir(root, args.step)
    try:
        out = export_checkpoint(model, checkpoint=step_dir, out=args.output)
    except WorkerError as err:
        raise CLIError(str(err)) from None
    print(f"exported {step_dir} to {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}))")
    return 0
