"""The Hugging Face examples end to end, as a user runs them: ``adaptis run`` trains the tiny
Qwen-MoE job on 2 ranks with checkpoints, ``adaptis export`` writes what ``from_pretrained``
loads. Real processes: the CLI as subprocesses, which launch their ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf-tiny-qwen-moe.yaml"


def _adaptis(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True,
                          text=True, timeout=400, cwd=cwd, check=False)


def test_example_trains_checkpoints_and_exports(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    run = _adaptis("run", str(EXAMPLE), "--json", "--steps", "2", "--checkpoint-every", "2",
                   "--profile", "estimate", "--metrics-port", "0", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["steps"] == 2 and summary["final_loss"] > 0
    out = tmp_path / "exported"
    export = _adaptis("export", str(EXAMPLE), "-o", str(out), cwd=tmp_path)
    assert export.returncode == 0, export.stderr[-3000:]
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    logits = model(input_ids=torch.arange(8)[None]).logits
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
