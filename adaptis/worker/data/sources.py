"""Training data for the workers: seeded synthetic tokens, a memory-mapped token file, or a local
text corpus tokenized with the model's tokenizer (:mod:`adaptis.worker.data.corpus`).

Sits under :mod:`adaptis.worker.runtime.executor`. A source is addressed by a *position* (the number
of sequences consumed so far), which is all a checkpoint needs to resume the data stream exactly.
Each step takes ``microbatches * microbatch_size`` sequences of ``sequence_length + 1`` tokens;
inputs are the first ``sequence_length`` tokens and targets the last ``sequence_length``.

The synthetic stream is learnable on purpose (a progress bar that shows a falling loss is a
better smoke test than noise): a seeded Markov chain over a small active vocabulary, where
each token is followed by its fixed successor three times out of four.

With R data-parallel replicas the position counts the sequences of every replica: step ``s``
starts at ``s * R * per_step`` and replica ``r`` reads its ``per_step`` sequences from
:func:`shard_position`, so the replicas together read exactly the stream one process would,
and a checkpoint's single position resumes them all.

A text corpus is packed across documents (each followed by the EOS id) into N sequences, the
token file's way: sequence ``k`` is tokens ``[k * seq_len, k * seq_len + seq_len + 1)``. Position
``i`` is epoch ``i // N`` and reads sequence ``perm_e[i % N]``, where ``perm_e`` is a permutation
seeded by (seed, epoch): each epoch visits every sequence once in a fresh order, and position
alone (a checkpoint's) says which sample comes next, across epochs too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from adaptis.api.job import DataSpec, TrainingSpec
from adaptis.api.model import Model
from adaptis.worker.data.corpus import tokenized
from adaptis.worker.errors import DataError

__all__ = ["Batch", "DataSource", "SyntheticTokens", "TextCorpus", "TokenFile", "open_source",
           "prepare_text", "shard_position"]

_ACTIVE_VOCAB = 512
_FOLLOW = 0.75


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's sequences: ``inputs`` and ``targets`` are int64 ``[sequences, seq_len]``."""

    inputs: torch.Tensor
    targets: torch.Tensor


def shard_position(*, position: int, replica: int, sequences: int) -> int:
    """Where replica ``replica`` starts reading, when the step starts at global ``position`` and
    each replica takes ``sequences`` sequences."""
    return position + replica * sequences


class DataSource(Protocol):
    def batch(self, *, position: int, sequences: int) -> Batch: ...


class SyntheticTokens:
    """Seeded Markov tokens; sequence ``i`` of the stream depends only on (seed, i)."""

    def __init__(self, *, vocab_size: int, sequence_length: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        n = min(_ACTIVE_VOCAB, vocab_size)
        self._active = torch.randperm(vocab_size, generator=gen)[:n]
        self._successor = torch.randperm(n, generator=gen)

    def batch(self, *, position: int, sequences: int) -> Batch:
        n = self._active.numel()
        steps = self.sequence_length + 1
        idx = torch.empty(sequences, steps, dtype=torch.long)
        jump = torch.empty(sequences, steps, dtype=torch.long)
        follow = torch.empty(sequences, steps, dtype=torch.bool)
        # One generator per sequence: sequence i is the same whichever batch reads it, so data
        # parallel replicas reading shards see exactly the rows one process would.
        for row in range(sequences):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + position + row)
            idx[row, 0] = torch.randint(n, (1,), generator=gen)
            jump[row] = torch.randint(n, (steps,), generator=gen)
            follow[row] = torch.rand(steps, generator=gen) < _FOLLOW
        for t in range(1, steps):
            idx[:, t] = torch.where(follow[:, t], self._successor[idx[:, t - 1]], jump[:, t])
        tokens = self._active[idx]
        return Batch(inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous())


class TokenFile:
    """A flat file of token ids, memory-mapped; sequence ``i`` starts at ``i * seq_len`` and the
    stream wraps around at the end of the file."""

    def __init__(self, *, path: str, dtype: str, vocab_size: int, sequence_length: int) -> None:
        p = Path(path)
        if not p.is_file():
            raise DataError(f"token file {p} does not exist")
        self._tokens = np.memmap(p, dtype=np.dtype(dtype), mode="r")
        self.sequence_length = sequence_length
        self.vocab_size = vocab_size
        self._count = (len(self._tokens) - 1) // sequence_length
        if self._count < 1:
            raise DataError(f"token file {p} holds {len(self._tokens)} tokens; "
                            f"need at least {sequence_length + 1}")

    def batch(self, *, position: int, sequences: int) -> Batch:
        starts = [i % self._count for i in range(position, position + sequences)]
        out = _packed_batch(self._tokens, starts=starts, length=self.sequence_length)
        top = max(int(out.inputs.max()), int(out.targets.max()))
        if top >= self.vocab_size:
            raise DataError(f"token file holds id {top} >= vocab_size {self.vocab_size}")
        return out


class TextCorpus:
    """A tokenized text corpus, packed and visited in a seeded order per epoch (module docstring)."""

    def __init__(self, *, tokens: np.ndarray, sequence_length: int, seed: int, shuffle: bool = True) -> None:
        self._tokens = tokens
        self.sequence_length = sequence_length
        self.seed = seed
        self.shuffle = shuffle
        self.count = (len(tokens) - 1) // sequence_length
        if self.count < 1:
            raise DataError(f"training.data.path: the corpus tokenizes to {len(tokens)} tokens; "
                            f"need at least sequenceLength + 1 = {sequence_length + 1}: add text "
                            "or shorten training.sequenceLength")
        self._epoch = -1
        self._order = np.arange(self.count)

    def order(self, epoch: int) -> np.ndarray:
        """The sequence indices epoch ``epoch`` visits, in order."""
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.count)
                           if self.shuffle else np.arange(self.count))
        return self._order

    def sequence_index(self, position: int) -> int:
        """The packed sequence that stream position ``position`` reads."""
        epoch, offset = divmod(position, self.count)
        return int(self.order(epoch)[offset])

    def batch(self, *, position: int, sequences: int) -> Batch:
        starts = [self.sequence_index(i) for i in range(position, position + sequences)]
        return _packed_batch(self._tokens, starts=starts, length=self.sequence_length)


def _packed_batch(tokens: np.ndarray, *, starts: list[int], length: int) -> Batch:
    """Packed sequences ``starts`` (indices in units of ``length``) of a token stream: each
    reads length + 1 tokens, the inputs and the targets one token apart."""
    rows = [np.asarray(tokens[i * length : i * length + length + 1], dtype=np.int64) for i in starts]
    both = torch.from_numpy(np.stack(rows))
    return Batch(inputs=both[:, :-1].contiguous(), targets=both[:, 1:].contiguous())


def open_source(spec: DataSpec, *, vocab_size: int, sequence_length: int, seed: int,
                tokenizer_dirs: Sequence[Path] = (), model_eos: int | None = None) -> DataSource:
    """The data source a job's ``training.data`` describes; a text corpus's default tokenizer
    is a ``tokenizer.json`` in one of ``tokenizer_dirs`` (the model's files: ``Model.file_dirs``)
    and ``model_eos`` the model's EOS id (``Model.eos_token_id``)."""
    if spec.source == "text":
        return _text(spec, vocab_size=vocab_size, sequence_length=sequence_length, seed=seed,
                     tokenizer_dirs=tokenizer_dirs, model_eos=model_eos)
    if spec.source == "token-file":
        if spec.path is None:
            raise DataError("training.data.path is required for a token file")
        return TokenFile(path=spec.path, dtype=spec.dtype, vocab_size=vocab_size,
                         sequence_length=sequence_length)
    return SyntheticTokens(vocab_size=vocab_size, sequence_length=sequence_length, seed=seed)


def prepare_text(training: TrainingSpec, *, model: Model) -> None:
    """Tokenize a job's text corpus into its cache before the ranks start (``adaptis run``):
    the ranks then find it, and bad data fails here, naming the field, rather than in a rank."""
    _text(training.data, vocab_size=model.vocab_size, sequence_length=training.sequence_length,
          seed=training.seed, tokenizer_dirs=model.file_dirs, model_eos=model.eos_token_id)


def _text(spec: DataSpec, *, vocab_size: int, sequence_length: int, seed: int,
          tokenizer_dirs: Sequence[Path], model_eos: int | None) -> TextCorpus:
    if spec.path is None:
        raise DataError("training.data.path is required for a text corpus")
    tokenizer = spec.tokenizer or _default_tokenizer(tokenizer_dirs)
    corpus = tokenized(path=spec.path, tokenizer=tokenizer, cache_dir=spec.cache_dir, model_eos=model_eos,
                       vocab_size=vocab_size)
    return TextCorpus(tokens=corpus.tokens, sequence_length=sequence_length, seed=seed, shuffle=spec.shuffle)


def _default_tokenizer(candidates: Sequence[Path]) -> str:
    """The tokenizer next to a model's files (a Hugging Face model's: its weights directory,
    then the directory of its config path)."""
    for d in candidates:
        if (d / "tokenizer.json").is_file():
            return str(d)
    where = " or ".join(str(d) for d in candidates) or "nowhere (the model is not a Hugging Face one)"
    raise DataError("training.data.tokenizer is required for source text: no tokenizer.json found "
                    f"next to the model ({where}); give the tokenizer.json or its directory")
