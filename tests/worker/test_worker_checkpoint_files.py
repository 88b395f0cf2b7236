"""Checkpoint files in one process (a real 1-rank gloo group, real executors and optimizers):
the file format, the resume under another plan, pruning, the "newest complete step" agreement
and the errors a user meets. The multi-rank resumes (killed ranks, shared and private
directories) are in test_worker_checkpoint.py and test_worker_reshard.py; these reach the same
code in the test process, where mutation testing (bench/mutation.py) can see it."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from worker_harness import SMALL_MODEL, one_rank_group  # noqa: F401 (the fixture)

from adaptis.api.job import TrainingSpec, WorkerConfig
from adaptis.api.plan import Plan
from adaptis.worker.data.sources import SyntheticTokens
from adaptis.worker.errors import CheckpointError
from adaptis.worker.runtime.executor import Executor
from adaptis.worker.state.checkpoint import (
    Resumed,
    agree_resume_step,
    clear_checkpoints,
    load_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)

TRAIN = TrainingSpec(microbatches=2, microbatch_size=2, sequence_length=8, grad_clip=None, seed=7)
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_rank_group")  # a real 1-rank gloo group (worker_harness)


def _three_stages() -> Plan:
    m = TRAIN.microbatches
    acts = [("F", s, mb) for mb in range(m) for s in range(3)]
    acts += [("BW", s, mb) for mb in reversed(range(m)) for s in (2, 1, 0)]
    return Plan(stages=[(0, 2), (2, 3), (3, 5)], placement=[[0, 1, 2]], actions=[acts])


def _one_stage() -> Plan:
    m = TRAIN.microbatches
    return Plan(stages=[(0, 5)], placement=[[0]],
                actions=[[("F", 0, mb) for mb in range(m)] + [("BW", 0, mb) for mb in range(m)]])


def _executor(plan: Plan, *, optimizer: str = "adamw", model=SMALL_MODEL) -> Executor:  # type: ignore[no-untyped-def]
    training = TRAIN.model_copy(update={"optimizer": TRAIN.optimizer.model_copy(update={"name": optimizer})})
    config = WorkerConfig(model=model, training=training, plan=plan.model_dump(mode="json"))
    return Executor(config, rank=0, world_size=1, device=CPU)


def _batch(position: int):  # type: ignore[no-untyped-def]
    data = SyntheticTokens(vocab_size=SMALL_MODEL.vocab_size, sequence_length=TRAIN.sequence_length, seed=7)
    return data.batch(position=position, sequences=TRAIN.microbatches * TRAIN.microbatch_size)


def _weights(ex: Executor) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in ex.named_parameters().items()}


def test_a_run_resumed_under_another_plan_continues_exactly(tmp_path: Path) -> None:
    # Three stages on the rank save after step 1; one stage loads it. The second step must then
    # match the uninterrupted run's: same weights, and AdamW's moments and step count (a fresh
    # optimizer's first update is lr x sign(grad), another step altogether).
    ex = _executor(_three_stages())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    assert path == tmp_path / "step-00000001" / "rank-0.pt"
    saved = _weights(ex)
    after = ex.step(_batch(4))
    fresh = _executor(_one_stage())
    resumed = load_checkpoint(tmp_path, executor=fresh, step=1)
    assert resumed == Resumed(step=1, position=4, tokens=32, samples=4, exact=True)
    for name, w in _weights(fresh).items():
        torch.testing.assert_close(w, saved[name], rtol=0, atol=0)
    again = fresh.step(_batch(4))
    assert again.loss == pytest.approx(after.loss, rel=1e-6)
    continued = _weights(ex)
    for name, w in _weights(fresh).items():
        torch.testing.assert_close(w, continued[name], rtol=1e-5, atol=1e-7)


def test_the_file_records_the_step_the_writers_and_state_by_name(tmp_path: Path) -> None:
    ex = _executor(_three_stages())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=3, position=12, tokens=96, samples=12)
    assert [p.name for p in path.parent.iterdir()] == ["rank-0.pt"]  # the temporary file is gone
    doc = torch.load(path, weights_only=True)
    assert {k: doc[k] for k in ("format", "step", "position", "tokens", "samples", "world_size",
                                "data_parallel", "zero_stage", "savers", "optimizer_name")} == {
        "format": 2, "step": 3, "position": 12, "tokens": 96, "samples": 12, "world_size": 1,
        "data_parallel": 1, "zero_stage": 0, "savers": [0], "optimizer_name": "adamw"}
    assert "fingerprint" not in doc  # a plan is no part of a checkpoint: any plan resumes it
    assert doc["model_spec"] == SMALL_MODEL.wire().model_dump(mode="json", by_alias=True)
    named = ex.named_parameters()
    assert set(doc["model"]) == set(named) and "0.weight" in named and "4.proj.weight" in named
    for name, p in named.items():
        assert torch.equal(doc["model"][name], p.detach())
    # Every parameter had a gradient, so AdamW holds (and the file records) a state for each.
    assert sorted(doc["optimizer_covers"]) == sorted(named) == sorted(doc["optimizer_state"])
    state = ex.optimizer.state[named["2.norm1.weight"]]
    assert torch.equal(doc["optimizer_state"]["2.norm1.weight"]["exp_avg"], state["exp_avg"])


class _Payload:
    """An object a checkpoint file must never make a rank import and build (a pickle can run code)."""


def test_a_file_whose_loading_would_build_arbitrary_objects_is_unreadable(tmp_path: Path) -> None:
    _file(tmp_path, step=2, rank=0, doc={"savers": [0]})
    _file(tmp_path, step=4, rank=0, doc={"savers": [0], "extra": _Payload()})
    assert agree_resume_step(tmp_path) == 2
    assert not (tmp_path / "step-00000004").exists()


def test_each_save_keeps_the_two_newest_steps_and_prunes_stale_ranks(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    save_checkpoint(tmp_path, executor=ex, step=1, position=0, tokens=0, samples=0)
    # A file an earlier plan of two ranks left: no rank of this job would ever remove it.
    stale = tmp_path / "step-00000001" / "rank-1.pt"
    stale.write_bytes((tmp_path / "step-00000001" / "rank-0.pt").read_bytes())
    save_checkpoint(tmp_path, executor=ex, step=2, position=0, tokens=0, samples=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
    save_checkpoint(tmp_path, executor=ex, step=3, position=0, tokens=0, samples=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    assert not stale.exists()


def test_pruning_an_old_step_leaves_a_file_that_is_no_ranks(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    save_checkpoint(tmp_path, executor=ex, step=1, position=0, tokens=0, samples=0)
    copy = tmp_path / "step-00000001" / "rank-0.bak.pt"  # a person's copy: not ours to delete
    copy.write_bytes((tmp_path / "step-00000001" / "rank-0.pt").read_bytes())
    for step in (2, 3):
        save_checkpoint(tmp_path, executor=ex, step=step, position=0, tokens=0, samples=0)
    assert sorted(p.name for p in (tmp_path / "step-00000001").iterdir()) == ["rank-0.bak.pt"]
    assert agree_resume_step(tmp_path) == 3


def test_a_step_past_eight_digits_resumes(tmp_path: Path) -> None:
    _file(tmp_path, step=7, rank=0, doc={"savers": [0]})
    _file(tmp_path, step=123_456_789, rank=0, doc={"savers": [0]})  # directory step-123456789
    assert agree_resume_step(tmp_path) == 123_456_789


def test_an_unwritable_directory_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "step-00000001").write_text("a file where the step's directory goes")
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step-00000001/rank-0.pt"):
        save_checkpoint(tmp_path, executor=_executor(_one_stage()), step=1, position=0, tokens=0, samples=0)


def _file(root: Path, *, step: int, rank: int, doc: object) -> None:
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    if isinstance(doc, bytes):
        (d / f"rank-{rank}.pt").write_bytes(doc)
    else:
        torch.save(doc, d / f"rank-{rank}.pt")


def test_the_agreed_step_is_the_newest_complete_one_and_newer_ones_are_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _file(tmp_path, step=2, rank=0, doc={"savers": [0]})
    _file(tmp_path, step=4, rank=0, doc={"savers": [0]})
    _file(tmp_path, step=6, rank=0, doc={"savers": [0, 1]})  # written by two ranks: rank 1's is missing
    _file(tmp_path, step=8, rank=0, doc=b"torn")  # unreadable: which ranks wrote it is unknown
    _file(tmp_path, step=7, rank=0, doc=[0])  # readable, but not a checkpoint: as unreadable
    (tmp_path / "step-00000009").mkdir()  # a directory with no rank file is no step
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / "rank-0.pt.tmp42").write_bytes(b"an interrupted write")
    # Files a person left there are no rank's: a copy beside a rank's file, a directory of theirs.
    (tmp_path / "step-00000004" / "rank-0.bak.pt").write_bytes(b"a copy")
    (tmp_path / "step-latest").mkdir()
    (tmp_path / "step-latest" / "rank-0.pt").write_bytes(b"a copy")
    with caplog.at_level(logging.INFO, logger="adaptis.worker.state.checkpoint"):
        assert agree_resume_step(tmp_path) == 4
    assert f"removed the incomplete checkpoint of step 6 in {tmp_path}" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000004",
                                                          "step-00000009", "step-00000010", "step-latest"]
    # Nothing complete: every step is removed, and the run starts fresh.
    only = tmp_path / "other"
    _file(only, step=3, rank=0, doc={"savers": [0, 1]})
    assert agree_resume_step(only) is None
    assert list(only.iterdir()) == []
    assert agree_resume_step(tmp_path / "never-written") is None


def test_a_missing_or_unreadable_file_and_another_model_are_refused(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    with pytest.raises(CheckpointError, match=r"rank 0 sees no checkpoint file in .*step-00000001"):
        load_checkpoint(tmp_path, executor=ex, step=1)
    _file(tmp_path, step=1, rank=0, doc=b"torn")
    with pytest.raises(CheckpointError, match=r"checkpoint file .*rank-0.pt cannot be read"):
        load_checkpoint(tmp_path, executor=ex, step=1)
    save_checkpoint(tmp_path, executor=ex, step=2, position=0, tokens=0, samples=0)
    other = dataclasses.replace(SMALL_MODEL, vocab_size=128)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(tmp_path, executor=_executor(_one_stage(), model=other), step=2)
    assert str(refused.value) == (f"checkpoint of step 2 in {tmp_path} is of another model "
                                  "(model.vocabSize: 256 there, 128 in this job)")


def test_a_parameter_in_no_file_is_named_with_the_fix(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=0, tokens=0, samples=0)
    doc = torch.load(path, weights_only=True)
    gone = sorted(doc["model"])[-6:]  # six missing: the message names the first five
    for name in gone:
        del doc["model"][name]
    torch.save(doc, path)
    with pytest.raises(CheckpointError) as missing:
        load_checkpoint(tmp_path, executor=_executor(_one_stage()), step=1)
    assert str(missing.value) == (
        f"checkpoint of step 1 in {tmp_path}: parameters {gone[:5]} are in none of the files rank 0 sees; "
        "under another plan, or with dataParallel > 1, a rank reads other ranks' files, so the checkpoint "
        "directory must be shared (a ReadWriteMany volume)")


def test_weights_come_from_any_rank_file_of_the_step(tmp_path: Path) -> None:
    # A two-rank plan saved the embedding half on rank 0 and the rest on rank 1 (faked here by
    # splitting one rank's file): a one-rank job reads both, its own first.
    ex = _executor(_one_stage())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    doc = torch.load(path, weights_only=True)
    names = sorted(doc["model"])
    low = set(names[: len(names) // 2])
    part = {**doc, "savers": [0, 1],
            "model": {k: v for k, v in doc["model"].items() if k in low},
            "optimizer_covers": [k for k in doc["optimizer_covers"] if k in low],
            "optimizer_state": {k: v for k, v in doc["optimizer_state"].items() if k in low}}
    rest = {**part, "model": {k: v for k, v in doc["model"].items() if k not in low},
            "optimizer_covers": [k for k in doc["optimizer_covers"] if k not in low],
            "optimizer_state": {k: v for k, v in doc["optimizer_state"].items() if k not in low},
            "step": 99}  # the header is read from this rank's own file only
    torch.save(part, path)
    torch.save(rest, path.with_name("rank-1.pt"))
    fresh = _executor(_three_stages())
    assert load_checkpoint(tmp_path, executor=fresh, step=1) == Resumed(step=1, position=4, tokens=32,
                                                                        samples=4, exact=True)
    for name, w in _weights(fresh).items():
        assert torch.equal(w, ex.named_parameters()[name].detach()), name
    for name, p in fresh.named_parameters().items():
        assert torch.equal(fresh.optimizer.state[p]["exp_avg"], ex.optimizer.state[ex.named_parameters()[name]]
                           ["exp_avg"]), name


def test_another_optimizer_kind_or_no_state_restores_weights_and_starts_fresh(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ex = _executor(_one_stage())
    ex.step(_batch(0))
    save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    sgd = _executor(_one_stage(), optimizer="sgd")
    with caplog.at_level(logging.WARNING, logger="adaptis.worker.state.checkpoint"):
        assert load_checkpoint(tmp_path, executor=sgd, step=1).exact is False
    assert ("checkpoint of step 1 holds adamw optimizer state, this job trains with sgd: weights restored, "
            "the optimizer starts fresh") in caplog.text
    assert all(torch.equal(w, ex.named_parameters()[k].detach()) for k, w in _weights(sgd).items())
    # Saved before any update: AdamW had no state yet; a job that has some cannot be exact.
    caplog.clear()
    early = tmp_path / "early"
    save_checkpoint(early, executor=_executor(_one_stage()), step=0, position=0, tokens=0, samples=0)
    with caplog.at_level(logging.WARNING, logger="adaptis.worker.state.checkpoint"):
        assert load_checkpoint(early, executor=_executor(_one_stage()), step=0).exact is True
        assert caplog.text == ""


def test_clearing_reports_what_was_there_and_a_scan_then_finds_nothing(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    for step in (1, 2):
        save_checkpoint(tmp_path, executor=ex, step=step, position=0, tokens=0, samples=0)
    _file(tmp_path, step=2, rank=3, doc={"savers": [0]})
    found = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert (found.steps, found.files, found.resume_step, found.incompatible) == ((1, 2), 3, 2, None)
    assert found.directory == tmp_path
    cleared = clear_checkpoints(tmp_path)
    assert (cleared.directory, cleared.steps, cleared.files, cleared.resume_step) == (tmp_path, (1, 2), 3, None)
    assert not tmp_path.exists()
    assert scan_checkpoints(tmp_path, model=SMALL_MODEL).files == 0


def test_a_parameter_without_recorded_optimizer_state_makes_the_whole_optimizer_start_fresh(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ex = _executor(_one_stage())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    doc = torch.load(path, weights_only=True)
    doc["optimizer_covers"].remove("2.norm1.weight")
    del doc["optimizer_state"]["2.norm1.weight"]
    torch.save(doc, path)
    fresh = _executor(_one_stage())
    with caplog.at_level(logging.WARNING, logger="adaptis.worker.state.checkpoint"):
        assert load_checkpoint(tmp_path, executor=fresh, step=1).exact is False
    assert ("checkpoint of step 1 has no optimizer state of ['2.norm1.weight'] (in the files rank 0 sees): "
            "weights restored, the optimizer starts fresh") in caplog.text
    assert fresh.optimizer.state_dict()["state"] == {}  # nothing half-restored


def test_reading_stops_once_this_rank_has_everything_it_needs(tmp_path: Path) -> None:
    # Another rank's file of the step is torn (a copy cut short): this rank's own file holds
    # every weight and state it needs, so it never opens that one.
    ex = _executor(_one_stage())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    path.with_name("rank-1.pt").write_bytes(b"torn")
    assert load_checkpoint(tmp_path, executor=_executor(_one_stage()), step=1).exact is True


def test_clearing_a_directory_never_written_finds_nothing(tmp_path: Path) -> None:
    cleared = clear_checkpoints(tmp_path / "never-written")
    assert (cleared.files, cleared.steps, cleared.resume_step, cleared.incompatible) == (0, (), None, None)


def test_a_scan_names_the_directory_and_why_it_cannot_resume(tmp_path: Path) -> None:
    empty = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert (empty.directory, empty.files, empty.steps, empty.resume_step) == (tmp_path, 0, (), None)
    _file(tmp_path, step=2, rank=0, doc=b"torn")
    torn = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert (torn.directory, torn.files, torn.steps, torn.resume_step) == (tmp_path, 1, (2,), None)
    assert torn.incompatible == ("no step has the files of every rank that wrote it (step 2 has the files of "
                                 "ranks 0, its files are unreadable)")
    # Two fields changed: both named, one after the other.
    spec = SMALL_MODEL.wire().model_dump(mode="json", by_alias=True)
    _file(tmp_path, step=4, rank=0, doc={"savers": [0], "model_spec": spec})
    other = dataclasses.replace(SMALL_MODEL, vocab_size=128, hidden=32)
    assert scan_checkpoints(tmp_path, model=other).incompatible == (
        "step 4's checkpoint is of another model (model.hidden: 16 there, 32 in this job; "
        "model.vocabSize: 256 there, 128 in this job)")
    # A spec today's ModelSpec cannot read is compared as written: every field either side lacks.
    _file(tmp_path, step=6, rank=0, doc={"savers": [0], "model_spec": {**spec, "experimental": 1}})
    odd = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert odd.resume_step is None and odd.incompatible == (
        "step 6's checkpoint is of another model (model.experimental: 1 there, None in this job)")


def test_a_step_with_one_torn_file_takes_its_savers_from_a_readable_one(tmp_path: Path) -> None:
    spec = SMALL_MODEL.wire().model_dump(mode="json", by_alias=True)
    _file(tmp_path, step=3, rank=0, doc={"savers": [0, 1], "model_spec": spec})
    _file(tmp_path, step=3, rank=1, doc=b"torn")
    assert scan_checkpoints(tmp_path, model=SMALL_MODEL).resume_step == 3
    # The other way round the file the scan reads the model from is torn: not resumable (rank 0
    # could not load it), and no crash.
    swapped = tmp_path / "swapped"
    _file(swapped, step=3, rank=0, doc=b"torn")
    _file(swapped, step=3, rank=1, doc={"savers": [0, 1], "model_spec": spec})
    found = scan_checkpoints(swapped, model=SMALL_MODEL)
    assert found.resume_step is None and found.incompatible


def test_a_file_with_every_optimizer_state_but_some_weights_is_not_the_last_read(tmp_path: Path) -> None:
    ex = _executor(_one_stage())
    ex.step(_batch(0))
    path = save_checkpoint(tmp_path, executor=ex, step=1, position=4, tokens=32, samples=4)
    doc = torch.load(path, weights_only=True)
    names = sorted(doc["model"])
    torch.save({**doc, "model": {k: doc["model"][k] for k in names[:3]}}, path)
    torch.save({**doc, "model": {k: doc["model"][k] for k in names[3:]}}, path.with_name("rank-1.pt"))
    fresh = _executor(_one_stage())
    assert load_checkpoint(tmp_path, executor=fresh, step=1).exact is True
    assert all(torch.equal(w, ex.named_parameters()[k].detach()) for k, w in _weights(fresh).items())
