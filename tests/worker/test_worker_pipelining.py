"""The pipelining adapter's hold on torch's private ``backward_one_chunk`` (issue 18).

The adapter times each backward as ``BW`` (fused) or ``B`` (input gradient) from the call's
``full_backward`` argument. These tests check that the installed torch still has that argument,
that it is read by name wherever it sits in the signature, and that a signature without it
fails loudly instead of swapping B and BW timings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.pipelining import PipelineStage

from adaptis.worker.errors import TorchApiError, WorkerError
from adaptis.worker.runtime.pipelining import backward_kind_of


def test_installed_torch_backward_one_chunk_has_the_names_the_adapter_reads() -> None:
    # Unbound: ``self`` comes first, as torch's runtime calls it through a bound method.
    kind_of = backward_kind_of(PipelineStage.backward_one_chunk)
    stage = object()
    assert kind_of(stage, 0) == "BW"  # torch's default is the fused backward
    assert kind_of(stage, 0, None, False) == "B"  # positional, as torch 2.11 calls it
    assert kind_of(stage, 0, loss=None, full_backward=False, last_backward=True) == "B"
    assert kind_of(stage, 0, full_backward=True) == "BW"


def test_the_argument_is_read_by_name_when_torch_reorders_the_signature() -> None:
    # A future torch that moves ``full_backward`` to second place: read positionally at index 2
    # this call would be a fused backward (``loss`` = None is falsy the other way round).
    def reordered(bwd_chunk_id: int, full_backward: bool = True, loss: Any = None) -> None:
        del bwd_chunk_id, full_backward, loss

    kind_of = backward_kind_of(reordered)
    assert kind_of(0, False, "loss") == "B"
    assert kind_of(0, True, None) == "BW"
    assert kind_of(0) == "BW"


def test_a_required_full_backward_is_read_from_the_call() -> None:
    def required(bwd_chunk_id: int, full_backward: bool) -> None:
        del bwd_chunk_id, full_backward

    kind_of = backward_kind_of(required)
    assert kind_of(1, False) == "B"
    assert kind_of(1, full_backward=True) == "BW"


@pytest.mark.parametrize(
    "fake",
    [
        pytest.param(lambda bwd_chunk_id, loss=None, fused=True: None, id="renamed"),
        pytest.param(lambda bwd_chunk_id, *args, **kwargs: None, id="only-varargs"),
        pytest.param(lambda bwd_chunk_id, *full_backward: None, id="varargs-named-alike"),
    ],
)
def test_a_signature_without_full_backward_fails_loudly_naming_torch(fake: Any) -> None:
    with pytest.raises(TorchApiError) as caught:
        backward_kind_of(fake)
    message = str(caught.value)
    assert f"torch {torch.__version__}" in message
    assert "'full_backward'" in message and "backward_one_chunk" in message
    # The CLI reports worker errors as one line; this one is one of them.
    assert isinstance(caught.value, WorkerError) and "\n" not in message


def test_an_unreadable_signature_fails_loudly_too() -> None:
    class Opaque:
        # What inspect makes of a compiled callable without signature data: it cannot read it.
        __signature__ = "not a signature"

        def __call__(self, *args: Any) -> None:
            del args

    with pytest.raises(TorchApiError, match=r"cannot read the signature"):
        backward_kind_of(Opaque())
