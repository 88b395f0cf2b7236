"""Data sources: deterministic by position (what a checkpoint resumes), learnable synthetic
tokens, a memory-mapped token file that wraps, and clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaptis.api.job import DataSpec
from adaptis.worker.data.sources import SyntheticTokens, TokenFile, open_source
from adaptis.worker.errors import DataError


def test_synthetic_batches_depend_only_on_seed_and_position() -> None:
    a = SyntheticTokens(vocab_size=5000, sequence_length=32, seed=4)
    b = SyntheticTokens(vocab_size=5000, sequence_length=32, seed=4)
    x, y = a.batch(position=8, sequences=4), b.batch(position=8, sequences=4)
    assert torch.equal(x.inputs, y.inputs) and torch.equal(x.targets, y.targets)
    assert x.inputs.shape == (4, 32) and x.inputs.dtype == torch.long
    assert torch.equal(x.inputs[:, 1:], x.targets[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(a.batch(position=12, sequences=4).inputs, x.inputs)
    assert int(x.inputs.max()) < 5000


def test_synthetic_tokens_are_predictable() -> None:
    src = SyntheticTokens(vocab_size=5000, sequence_length=64, seed=0)
    batch = src.batch(position=0, sequences=16)
    pairs: dict[int, dict[int, int]] = {}
    for row_in, row_out in zip(batch.inputs.tolist(), batch.targets.tolist(), strict=True):
        for a, b in zip(row_in, row_out, strict=True):
            pairs.setdefault(a, {}).setdefault(b, 0)
            pairs[a][b] += 1
    followed = sum(max(v.values()) for v in pairs.values()) / batch.targets.numel()
    assert followed > 0.6  # the successor rule holds three times out of four


def test_token_file_is_memory_mapped_and_wraps(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    src = open_source(DataSpec(source="token-file", path=str(path), dtype="uint16"), vocab_size=1000,
                      sequence_length=10, seed=0)
    assert isinstance(src, TokenFile)
    batch = src.batch(position=0, sequences=2)
    assert batch.inputs.tolist()[1] == list(range(10, 20))
    assert batch.targets.tolist()[1] == list(range(11, 21))
    wrapped = src.batch(position=9, sequences=2)  # 9 full sequences fit: index 9 is index 0
    assert wrapped.inputs.tolist()[0] == list(range(0, 10))


def test_token_file_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        TokenFile(path=str(tmp_path / "none"), dtype="uint16", vocab_size=10, sequence_length=4)
    small = tmp_path / "small.bin"
    np.arange(3, dtype=np.uint32).tofile(small)
    with pytest.raises(DataError, match="need at least"):
        TokenFile(path=str(small), dtype="uint32", vocab_size=10, sequence_length=4)
    big = tmp_path / "big.bin"
    np.full(20, 50, dtype=np.uint16).tofile(big)
    with pytest.raises(DataError, match="vocab_size"):
        TokenFile(path=str(big), dtype="uint16", vocab_size=10, sequence_length=4).batch(position=0, sequences=1)
