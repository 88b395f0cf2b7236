"""A text corpus through real ranks: 2 replicas x 2 pipeline ranks (4 gloo processes through the
local launcher) trained on a tokenized corpus short enough that the run crosses epochs, stopped
at a checkpoint and rerun, continue the loss curve of an uninterrupted run exactly: the data
position alone resumes the shuffled, sharded stream at the exact sample."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_harness import small_config

from adaptis.api.events import WorkerEvent
from adaptis.api.job import DataSpec
from adaptis.worker.run.launcher import LocalLauncher

pytestmark = pytest.mark.slow  # three 4-rank runs: about a minute on 2 cores

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "data" / "tiny-tokenizer"
STEPS, STOP, REPLICAS = 6, 3, 2


def _config(corpus: Path, cache: Path, *, steps: int, checkpoint_dir: str | None = None):
    base = small_config(steps=steps, checkpoint_dir=checkpoint_dir, checkpoint_every=STOP if checkpoint_dir else 0)
    data = DataSpec(source="text", path=str(corpus), tokenizer=str(TOKENIZER), cache_dir=str(cache))
    return base.model_copy(update={"data_parallel": REPLICAS,
                                   "training": base.training.model_copy(update={"data": data})})


def _losses(config, workdir: Path) -> dict[int, float]:
    events: list[WorkerEvent] = []
    LocalLauncher(config, world_size=2 * REPLICAS, workdir=workdir).run(events.append)
    out: dict[int, float] = {}
    for e in events:
        if e.event == "step":
            assert out.setdefault(e.step, e.loss) == e.loss  # every rank: the same loss
    return out


def test_a_text_corpus_run_resumes_at_the_exact_sample_across_epochs(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    notes = (REPO / "examples" / "data" / "tiny-corpus" / "notes.jsonl").read_text().splitlines()
    corpus.write_text("\n".join(notes[:3]) + "\n")  # 297 tokens: 18 sequences of 17
    cache = tmp_path / "cache"
    ref = _losses(_config(corpus, cache, steps=STEPS), tmp_path / "ref")
    index = json.loads(next(cache.glob("*.json")).read_text())
    sequences = (index["tokens"] - 1) // 16
    per_step = 4 * REPLICAS  # microbatches x size 1 x replicas
    # The checkpoint lands mid-way through the second epoch and the rerun crosses into a third.
    assert sequences < STOP * per_step and STOP * per_step % sequences and STEPS * per_step > 2 * sequences, sequences
    assert sorted(ref) == list(range(1, STEPS + 1))
    ckpt = tmp_path / "ckpt"
    _losses(_config(corpus, cache, steps=STOP, checkpoint_dir=str(ckpt)), tmp_path / "first")
    resumed = _losses(_config(corpus, cache, steps=STEPS, checkpoint_dir=str(ckpt)), tmp_path / "second")
    assert sorted(resumed) == list(range(STOP + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == pytest.approx(ref[step], rel=1e-6), f"step {step}"
