"""Fast, in-process checks of the name-keyed checkpoint pieces (the gloo runs are in
test_worker_reshard.py): optimizer state moves between any split of the parameters, a
half-found state is refused whole, and a step's completeness comes from its recorded savers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from worker_harness import SMALL_MODEL

from adaptis.worker.state.checkpoint import _complete, _recorded_savers, scan_checkpoints
from adaptis.worker.state.named_state import export_state, held_names, held_optimizer, import_state

NAMES = ("0.weight", "1.weight", "2.weight")


def _params(seed: int = 0) -> dict[str, nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(torch.randn(3, 2, generator=g)) for n in NAMES}


def _train(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], *, steps: int, start: int) -> None:
    for k in range(start, start + steps):
        opt.zero_grad()
        loss = sum(((p * (i + 1 + k)).sin()).sum() for i, p in enumerate(params.values()))
        loss.backward()  # type: ignore[union-attr]
        opt.step()


def test_adamw_state_moves_from_one_optimizer_to_any_split_and_continues_exactly() -> None:
    ref = _params()
    opt = torch.optim.AdamW(list(ref.values()), lr=0.05)
    _train(opt, ref, steps=2, start=0)
    saved = export_state(opt, named=ref)
    assert set(saved) == set(NAMES) and set(saved["1.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    weights = {n: p.detach().clone() for n, p in ref.items()}
    _train(opt, ref, steps=2, start=2)  # the uninterrupted run

    # Another partition: "rank" a holds layer 0, "rank" b layers 1 and 2.
    moved = _params(seed=1)
    with torch.no_grad():
        for n, p in moved.items():
            p.copy_(weights[n])
    a = torch.optim.AdamW([moved["0.weight"]], lr=0.05)
    b = torch.optim.AdamW([moved["1.weight"], moved["2.weight"]], lr=0.05)
    assert held_names(b, named=moved) == ["1.weight", "2.weight"]
    assert import_state(a, named=moved, find=saved) == []
    assert import_state(b, named=moved, find=saved) == []
    for k in (2, 3):  # the same two steps, each optimizer stepping its share
        for o in (a, b):
            o.zero_grad()
        sum(((p * (i + 1 + k)).sin()).sum() for i, p in enumerate(moved.values())).backward()  # type: ignore[union-attr]
        a.step()
        b.step()
    for n in NAMES:
        torch.testing.assert_close(moved[n], ref[n], rtol=0, atol=0, msg=n)


def test_a_state_found_only_in_part_is_not_loaded_at_all() -> None:
    params = _params()
    opt = torch.optim.AdamW(list(params.values()), lr=0.05)
    _train(opt, params, steps=1, start=0)
    saved = export_state(opt, named=params)
    other = _params()
    fresh = torch.optim.AdamW(list(other.values()), lr=0.05)
    assert import_state(fresh, named=other, find={NAMES[0]: saved[NAMES[0]]}) == list(NAMES[1:])
    partial = {n: saved[n] for n in NAMES[:2]}
    assert import_state(fresh, named=other, find=partial) == ["2.weight"]
    assert not fresh.state  # nothing half-restored
    # Recorded as covered but without state (no gradient yet): restored as "none yet".
    assert import_state(fresh, named=other, find={**partial, "2.weight": None}) == []
    assert set(fresh.state) == {other["0.weight"], other["1.weight"]}
    torch.testing.assert_close(fresh.state[other["1.weight"]]["exp_avg"], saved["1.weight"]["exp_avg"])


def test_a_parameter_without_a_gradient_yet_has_no_state_and_the_others_still_do() -> None:
    params = _params()
    opt = torch.optim.AdamW(list(params.values()), lr=0.05)
    params["1.weight"].grad = torch.ones(3, 2)
    params["2.weight"].grad = torch.ones(3, 2)
    opt.step()  # "0.weight" had no gradient: torch made no state for it
    saved = export_state(opt, named=params)
    assert set(saved) == {"1.weight", "2.weight"}
    assert held_names(opt, named=params) == list(NAMES)  # covered all the same


def test_a_zero_1_rank_holds_only_its_share() -> None:
    from adaptis.api.mesh import Mesh
    from adaptis.worker.runtime.replicas import ZeroOptimizer

    params = _params()
    # Two replicas of one pipeline rank: shares by size, in order (no collective until step()).
    zero = ZeroOptimizer(list(params.values()), make=lambda ps: torch.optim.AdamW(ps, lr=0.05),
                         mesh=Mesh(pods=2, per_pod=1, replicas=2), rank=1, group=None)
    assert held_optimizer(zero) is zero.local
    assert held_names(held_optimizer(zero), named=params) == ["1.weight"]
    plain = torch.optim.AdamW(list(params.values()), lr=0.05)
    assert held_optimizer(plain) is plain


def test_a_parameter_under_two_names_is_found_by_either() -> None:
    shared = nn.Parameter(torch.ones(2, 2))
    named = {"0.weight": shared, "4.weight": shared}  # a tied embedding and head on one rank
    opt = torch.optim.AdamW([shared], lr=0.1)
    shared.grad = torch.full((2, 2), 0.5)
    opt.step()
    saved = export_state(opt, named=named)
    assert set(saved) == {"0.weight", "4.weight"}
    head = nn.Parameter(torch.ones(2, 2))  # the head's own copy on another rank
    copy = torch.optim.AdamW([head], lr=0.1)
    assert import_state(copy, named={"4.weight": head}, find={"4.weight": saved["4.weight"]}) == []
    torch.testing.assert_close(copy.state[head]["exp_avg"], opt.state[shared]["exp_avg"])


def test_a_parameter_without_a_name_is_not_held_not_saved_and_blocks_a_restore() -> None:
    """A parameter the optimizer steps but no name covers cannot be saved by name; a restore
    names it by its shape and loads nothing (it would otherwise restart from a fresh state)."""
    params = _params()
    anon = nn.Parameter(torch.zeros(2, 5))
    opt = torch.optim.AdamW([*params.values(), anon], lr=0.05)
    for q in opt.param_groups[0]["params"]:
        q.grad = torch.ones_like(q)
    opt.step()
    assert held_names(opt, named=params) == list(NAMES)
    saved = export_state(opt, named=params)
    assert set(saved) == set(NAMES)
    other = _params()
    fresh = torch.optim.AdamW([*other.values(), nn.Parameter(torch.zeros(2, 5))], lr=0.05)
    assert import_state(fresh, named=other, find=saved) == ["<unnamed parameter (2, 5)>"]
    assert not fresh.state


def test_state_that_is_not_a_tensor_moves_as_it_is_and_the_restored_tensors_are_copies() -> None:
    # L-BFGS keeps counters (ints), a step size (float) and lists of tensors beside tensors.
    params = _params()
    opt = torch.optim.LBFGS(list(params.values()), lr=0.1, max_iter=3)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = sum((p.sin() * (i + 1)).sum() for i, p in enumerate(params.values()))
        loss.backward()  # type: ignore[union-attr]
        return loss  # type: ignore[return-value]

    opt.step(closure)
    saved = export_state(opt, named=params)
    first = saved["0.weight"]  # L-BFGS keeps its whole state on the first parameter
    assert isinstance(first["n_iter"], int) and first["n_iter"] == opt.state[params["0.weight"]]["n_iter"]
    other = _params()
    fresh = torch.optim.LBFGS(list(other.values()), lr=0.1, max_iter=3)
    find = {"0.weight": first, "1.weight": None, "2.weight": None}
    assert import_state(fresh, named=other, find=find) == []
    restored = fresh.state[other["0.weight"]]
    assert (restored["n_iter"], restored["func_evals"]) == (first["n_iter"], first["func_evals"])
    torch.testing.assert_close(restored["d"], first["d"], rtol=0, atol=0)
    # The source may be a memory-mapped file that a later prune unlinks: the optimizer holds a
    # copy, not a view of it.
    kept = restored["d"].clone()
    first["d"].fill_(7.0)
    torch.testing.assert_close(restored["d"], kept, rtol=0, atol=0)


def test_a_step_is_complete_when_its_recorded_savers_are_seen_together() -> None:
    # Rank 0 sees its own files, rank 1 its own: step 4 of a 2-saver job is complete only
    # in the union; step 6 lacks rank 1's file; step 8 was written by a 3-saver job.
    views = [{4: ([0], [0, 1]), 6: ([0], [0, 1]), 8: ([0, 1], [0, 1, 2])},
             {4: ([1], [0, 1]), 8: ([1], None)}]
    assert _complete(views) == [4]
    assert _complete([{2: ([0], None)}]) == []
    # The savers are what the file records, never guessed from its topology.
    assert _recorded_savers({"savers": [0, 1], "world_size": 4}) == [0, 1]
    assert _recorded_savers({"world_size": 4, "data_parallel": 2, "zero_stage": 0}) is None


def test_scan_resumes_any_plan_and_names_what_is_missing(tmp_path: Path) -> None:
    doc = {"model_spec": SMALL_MODEL.wire().model_dump(mode="json", by_alias=True), "savers": [0, 1, 2]}
    for step, ranks in ((4, (0, 1, 2)), (6, (0, 2))):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        for r in ranks:
            torch.save(doc, d / f"rank-{r}.pt")
    found = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert (found.resume_step, found.incompatible, found.steps, found.files) == (4, None, (4, 6), 5)
    for r in (0, 1, 2):
        (tmp_path / "step-00000004" / f"rank-{r}.pt").unlink()
    gone = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert gone.resume_step is None
    assert gone.incompatible == ("no step has the files of every rank that wrote it (step 6 has the files of "
                                 "ranks 0, 2, written by ranks 0, 1, 2)")


@pytest.mark.parametrize("garbage", [b"x", b""])
def test_an_unreadable_file_counts_as_absent(tmp_path: Path, garbage: bytes) -> None:
    d = tmp_path / "step-00000002"
    d.mkdir()
    (d / "rank-0.pt").write_bytes(garbage)
    scan = scan_checkpoints(tmp_path, model=SMALL_MODEL)
    assert scan.resume_step is None and "its files are unreadable" in str(scan.incompatible)
