"""The text-corpus example as a user runs it: ``adaptis run examples/hf-tiny-llama-text.yaml``
from the repository root (its paths are relative to where adaptis run starts) tokenizes the
tiny corpus before any rank starts and trains a falling loss; a tokenizer bigger than the
model's vocabulary exits 2 naming training.data.tokenizer, before planning or any rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf-tiny-llama-text.yaml"


def _adaptis(*args: str, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaptis", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, check=False)


def test_the_example_trains_on_the_tokenized_corpus(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["training"]["data"]["cacheDir"] = str(tmp_path / "cache")  # not the shared temp dir
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run = _adaptis("run", str(manifest), "--json", "--steps", "8", "--profile", "estimate", "--metrics-port", "0",
                   "--checkpoint-every", "0", "--workdir", str(tmp_path / "w"))
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout)
    assert summary["steps"] == 8 and summary["final_loss"] < summary["first_loss"], summary
    indexes = list((tmp_path / "cache").glob("*.json"))
    assert len(indexes) == 1, indexes  # one corpus, one tokenizer: one cache entry
    index = json.loads(indexes[0].read_text())
    assert index["documents"] == 10 and index["tokens"] > 1500  # 2 text files + 8 JSONL lines


def test_a_tokenizer_bigger_than_the_vocabulary_is_refused_before_any_rank(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["model"]["huggingface"]["config"]["vocab_size"] = 200
    doc["spec"]["training"]["data"]["cacheDir"] = str(tmp_path / "cache")
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run = _adaptis("run", str(manifest), "--workdir", str(tmp_path / "w"), "--metrics-port", "0", timeout=120)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "training.data.tokenizer: the tokenizer examples/data/tiny-tokenizer has 256 tokens but the " \
           "model's vocab_size is 200" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "planned" not in run.stdout
    assert not list((tmp_path / "w").glob("rank-*.log"))
