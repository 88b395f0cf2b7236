"""The planner's costs at tensor-parallel degree T (adaptis.planner.tensor_parallel), worked by
hand, and what they change in a plan: a device is a tensor group, its layers cost 1/T of their
split share plus their all-reduces, and memory that binds at T = 1 fits at T = 2."""

from __future__ import annotations

from typing import Any

import pytest

from adaptis.api.job import BlockSpec, JobSpec, TrainingSpec
from adaptis.api.model import ZooModel
from adaptis.api.problem import Link, parse_problem
from adaptis.planner.costs import Costs
from adaptis.planner.estimate import estimate_layers
from adaptis.planner.strategies import plan_strategy
from adaptis.planner.tensor_parallel import ALL_REDUCES_BY_KIND, all_reduce_seconds

LINK = {"bandwidth_bytes_per_s": 1e11, "latency_s": 1e-6}


def _doc(*, tensor: int, **layer: Any) -> dict[str, Any]:
    body = {"name": "block", "forward": 10.0, "backward": 8.0, "weight": 6.0, "output_bytes": 4e6,
            "param_bytes": 1.6e9, "activation_bytes": 2e8, "optimizer": 4.0, **layer}
    return {"microbatches": 4, "devices": {"count": 1}, "layers": [body], "tensor_parallel": tensor,
            "network": {"intra_node": LINK}}


def test_a_split_layer_costs_a_quarter_plus_its_all_reduces() -> None:
    costs = Costs.from_problem(parse_problem(_doc(tensor=4)))
    # Ring all-reduce of 4 MB among 4: 2 x 3 latencies + 2 x 3/4 x 4e6 / 1e11 s = 6e-6 + 6e-5 s.
    ring_ms = (6 * 1e-6 + 1.5 * 4e6 / 1e11) * 1e3
    assert all_reduce_seconds(4e6, ranks=4, link=Link(**LINK)) * 1e3 == pytest.approx(ring_ms)
    assert costs.forward[0] == pytest.approx(10.0 / 4 + 2 * ring_ms)  # default: 2 all-reduces
    assert costs.backward[0] == pytest.approx(8.0 / 4 + 2 * ring_ms)
    assert costs.weight[0] == pytest.approx(6.0 / 4)  # W is local to the shard
    assert costs.fused[0] == pytest.approx(14.0 / 4 + 2 * ring_ms)
    assert costs.param_bytes[0] == pytest.approx(1.6e9 / 4)
    assert costs.grad_bytes[0] == pytest.approx(1.6e9 / 16)
    assert costs.activation_bytes[0] == pytest.approx(2e8 / 4)
    assert costs.optimizer[0] == pytest.approx(1.0)
    assert costs.output_bytes[0] == 4e6  # the activation between stages stays whole


def test_a_layer_kept_whole_costs_what_it_did() -> None:
    whole = Costs.from_problem(parse_problem(_doc(tensor=1)))
    kept = Costs.from_problem(parse_problem(_doc(tensor=4, tensor_split=0.0, tensor_all_reduces=0)))
    assert (kept.forward, kept.backward, kept.weight, kept.param_bytes) == (
        whole.forward, whole.backward, whole.weight, whole.param_bytes)
    half = Costs.from_problem(parse_problem(_doc(tensor=2, tensor_split=0.5, tensor_all_reduces=1)))
    ring_ms = (2 * 1e-6 + 1.0 * 4e6 / 1e11) * 1e3
    assert half.forward[0] == pytest.approx(10.0 * 0.75 + ring_ms)
    assert half.param_bytes[0] == pytest.approx(1.6e9 * 0.75)


def test_the_tensor_link_defaults_to_the_intra_node_one() -> None:
    slow = {**_doc(tensor=2), "network": {"intra_node": LINK, "tensor": {"bandwidth_bytes_per_s": 1e9}}}
    fast, own = (Costs.from_problem(parse_problem(d)) for d in (_doc(tensor=2), slow))
    assert own.forward[0] - 5.0 == pytest.approx(2 * 4e6 / 1e9 * 1e3)  # 1 / 2 x 2 x 4 MB at 1 GB/s
    assert own.forward[0] > fast.forward[0] > 5.0


MODEL = ZooModel(vocab_size=32768, hidden=1024, heads=16,
                 blocks=[BlockSpec(kind="mamba", count=2), BlockSpec(kind="attention", count=4),
                         BlockSpec(kind="moe", count=2, experts=4, top_k=2)])
TRAINING = TrainingSpec(microbatches=8, microbatch_size=1, sequence_length=1024)


def test_the_estimate_marks_what_the_worker_shards() -> None:
    layers = estimate_layers(MODEL, TRAINING)
    assert [lay.tensor_split for lay in layers] == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert [lay.tensor_all_reduces for lay in layers] == [ALL_REDUCES_BY_KIND[k] for k in (
        "embedding", "mamba", "mamba", *["attention"] * 4, "moe", "moe", "head")]


def _problem(*, tensor: int, memory: float | None) -> Any:
    from adaptis.worker.profiling.job_problem import estimate_problem

    spec = JobSpec(model=MODEL, training=TRAINING,
                   parallelism={"workers": 2, "gpusPerWorker": 2 * tensor, "tensorParallel": tensor})
    problem = estimate_problem(spec, devices=4)
    devices = {"count": 4, "per_node": 4, **({"memory_bytes": memory} if memory else {})}
    return parse_problem({**problem.model_dump(mode="json", exclude_none=True), "devices": devices,
                          "network": {"intra_node": LINK}})


def test_tensor_parallel_plans_a_faster_pipeline_and_fits_where_one_gpu_does_not() -> None:
    one, two = (plan_strategy(_problem(tensor=t, memory=None), "1f1b").plan for t in (1, 2))
    assert one is not None and two is not None
    # Compute halves on the split layers, the Mamba blocks and the all-reduces do not.
    assert 0.5 * one.predicted.iteration_time < two.predicted.iteration_time < 0.8 * one.predicted.iteration_time
    peak = max(one.predicted.peak_memory_bytes)
    assert max(two.predicted.peak_memory_bytes) < 0.7 * peak  # weights and most activations halve
    tight = 0.7 * peak  # what one GPU of a T = 1 device cannot hold as planned
    assert not plan_strategy(_problem(tensor=1, memory=tight), "1f1b").result.feasible
    fits = plan_strategy(_problem(tensor=2, memory=tight), "1f1b")
    assert fits.result.feasible and fits.plan is not None
    assert max(fits.plan.predicted.peak_memory_bytes) <= tight


def test_sequence_parallel_sends_one_tensor_rank_s_share_of_the_sequence() -> None:
    plain = Costs.from_problem(parse_problem(_doc(tensor=4)))
    seq = Costs.from_problem(parse_problem({**_doc(tensor=4), "sequence_parallel": True}))
    assert seq.output_bytes[0] == pytest.approx(4e6 / 4)  # each rank sends its s/T tokens
    # The all-gathers and reduce-scatters move what the all-reduces did: times unchanged.
    assert (seq.forward, seq.backward, seq.fused, seq.activation_bytes, seq.param_bytes) == (
        plain.forward, plain.backward, plain.fused, plain.activation_bytes, plain.param_bytes)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_parallel > 1"):
        parse_problem({**_doc(tensor=1), "sequence_parallel": True})


@pytest.mark.parametrize(("kind", "reduces", "extra"), [("mamba", 0, 0.5), ("moe", 2, 0.5), ("head", 0, 0.5),
                                                   ("embedding", 1, -0.5), ("attention", 2, 0.0)])
def test_sequence_parallel_charges_each_kind_s_gathers(kind: str, reduces: int, extra: float) -> None:
    """A ring all-gather or reduce-scatter of 4 MB among 4 is half the all-reduce: (3 latencies
    + 3/4 x 4e6 / 1e11 s); Mamba, MoE and the head gather once more a pass, the embedding's
    all-reduce is a reduce-scatter."""
    ring_ms = (6 * 1e-6 + 1.5 * 4e6 / 1e11) * 1e3
    layer = {"kind": kind, "tensor_all_reduces": reduces, "tensor_split": 0.0 if kind == "mamba" else 1.0}
    plain = Costs.from_problem(parse_problem(_doc(tensor=4, **layer)))
    seq = Costs.from_problem(parse_problem({**_doc(tensor=4, **layer), "sequence_parallel": True}))
    for pass_ in ("forward", "backward", "fused"):
        assert getattr(seq, pass_)[0] - getattr(plain, pass_)[0] == pytest.approx(extra * ring_ms), pass_
    assert seq.weight == plain.weight  # W stays local


def test_sequence_parallel_shortens_a_pipeline_bound_by_its_transfers() -> None:
    """Two stages on two devices over a slow link: the transfers between them shrink by T."""
    slow = {"bandwidth_bytes_per_s": 1e8, "latency_s": 0.0}
    layer = {"forward": 1.0, "backward": 1.0, "weight": 1.0, "output_bytes": 4e6}
    doc = {"microbatches": 4, "devices": {"count": 2, "per_node": 1}, "tensor_parallel": 2,
           "layers": [{"name": "a", **layer}, {"name": "b", **layer}],
           "network": {"intra_node": LINK, "inter_node": slow}}
    plain, seq = (plan_strategy(parse_problem({**doc, "sequence_parallel": sp}), "1f1b").plan
                  for sp in (False, True))
    assert plain is not None and seq is not None
    hop_ms = 4e6 / 1e8 * 1e3  # 40 ms a transfer whole, 20 ms sequence-sharded
    assert plain.predicted.iteration_time - seq.predicted.iteration_time >= hop_ms / 2
