"""The text corpus source (training.data.source: text), on real files with the real tokenizer of
examples/data/tiny-tokenizer: ids are the tokenizers package's encoding with EOS after each
document, tokenized once into a hash-keyed cache (one process tokenizes, the racing one waits),
shuffled per epoch by seed as a permutation, sharded disjointly across replicas, resumable at the
exact sample from a position alone, and bad input errors naming the field."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from adaptis.api.hf_model import HuggingFaceSpec
from adaptis.api.job import DataSpec
from adaptis.api.model import HuggingFaceModel
from adaptis.worker.data.corpus import tokenized
from adaptis.worker.data.sources import TextCorpus, open_source, shard_position
from adaptis.worker.errors import DataError

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "examples" / "data" / "tiny-tokenizer"
CORPUS = REPO / "examples" / "data" / "tiny-corpus"
EOS = 1  # "</s>" in the tiny tokenizer (tokenizer_config.json's eos_token)


def _corpus(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("The river pays its rent in the only coin it has.\n")
    (root / "sub" / "b.jsonl").write_text(
        json.dumps({"text": "Seven geese walked along the road."}) + "\n\n"
        + json.dumps({"text": "The baker rises at four.", "id": 2}) + "\n")
    (root / "skipped.bin").write_bytes(b"\xff\xfe not text")  # not a corpus suffix: left out
    return root


def _source(path: Path, tmp_path: Path, *, seq: int = 8, seed: int = 0, shuffle: bool = True) -> TextCorpus:
    spec = DataSpec(source="text", path=str(path), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "cache"),
                    shuffle=shuffle)
    src = open_source(spec, vocab_size=256, sequence_length=seq, seed=seed)
    assert isinstance(src, TextCorpus)
    return src


def test_ids_are_the_tokenizers_encoding_with_eos_after_each_document(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    docs = ["The river pays its rent in the only coin it has.\n", "Seven geese walked along the road.",
            "The baker rises at four."]  # a.txt, then sub/b.jsonl's lines in order
    expected: list[int] = []
    for d in docs:
        expected += [*tok.encode(d, add_special_tokens=False).ids, EOS]
    corpus = _corpus(tmp_path)
    got = tokenized(path=str(corpus), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "c"))
    assert got.tokens.tolist() == expected
    assert got.eos_id == EOS and len(got.document_starts) == 3 and got.built
    again = tokenized(path=str(corpus), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "c"))
    assert not again.built and again.key == got.key  # read from the cache, not tokenized again
    (tmp_path / "corpus" / "a.txt").write_text("Changed.\n")  # new bytes: a new key, new tokens
    changed = tokenized(path=str(tmp_path / "corpus"), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "c"))
    assert changed.built and changed.key != got.key
    assert changed.tokens.tolist()[:len(tok.encode("Changed.\n").ids)] == tok.encode("Changed.\n").ids


def test_batches_are_the_packed_sequences(tmp_path: Path) -> None:
    tokens = tokenized(path=str(CORPUS), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "cache")).tokens
    src = _source(CORPUS, tmp_path, seq=16)
    batch = src.batch(position=5, sequences=3)
    for row in range(3):
        k = src.sequence_index(5 + row)
        window = tokens[k * 16 : k * 16 + 17].astype(np.int64)
        assert batch.inputs[row].tolist() == window[:-1].tolist()
        assert batch.targets[row].tolist() == window[1:].tolist()


def test_each_epoch_is_a_seeded_permutation(tmp_path: Path) -> None:
    src = _source(CORPUS, tmp_path, seq=16, seed=3)
    n = src.count
    assert n > 50  # the shipped corpus packs into enough sequences to make the orders telling
    epoch0 = [src.sequence_index(i) for i in range(n)]
    epoch1 = [src.sequence_index(i) for i in range(n, 2 * n)]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert epoch0 != list(range(n)) and epoch0 != epoch1  # shuffled, afresh each epoch
    same = _source(CORPUS, tmp_path, seq=16, seed=3)
    assert [same.sequence_index(i) for i in range(2 * n)] == epoch0 + epoch1  # deterministic
    other = _source(CORPUS, tmp_path, seq=16, seed=4)
    assert [other.sequence_index(i) for i in range(n)] != epoch0
    plain = _source(CORPUS, tmp_path, seq=16, seed=3, shuffle=False)
    assert [plain.sequence_index(i) for i in range(n, 2 * n)] == list(range(n))


def test_replicas_read_disjoint_shards_that_cover_each_epoch(tmp_path: Path) -> None:
    src = _source(CORPUS, tmp_path, seq=16, seed=1)
    tokens = tokenized(path=str(CORPUS), tokenizer=str(TOKENIZER), cache_dir=str(tmp_path / "cache")).tokens
    # Which packed sequence a batch row is, from its tokens alone (the shipped text repeats none).
    index = {tuple(tokens[k * 16 : k * 16 + 16].tolist()): k for k in range(src.count)}
    assert len(index) == src.count
    replicas, per_step = 2, 3
    assert src.count % (replicas * per_step) == 0, src.count  # the steps end with the epoch
    read: dict[int, list[int]] = {0: [], 1: []}
    for step in range(2 * src.count // (replicas * per_step)):  # two epochs
        for r in range(replicas):
            start = shard_position(position=step * replicas * per_step, replica=r, sequences=per_step)
            read[r] += [index[tuple(row)] for row in src.batch(position=start, sequences=per_step).inputs.tolist()]
    half = len(read[0]) // 2
    for epoch in (slice(0, half), slice(half, None)):
        a, b = read[0][epoch], read[1][epoch]
        assert not set(a) & set(b), "two replicas read the same sequence in one epoch"
        assert sorted(a + b) == list(range(src.count)), "the replicas together miss a sequence"


def test_a_resumed_stream_reads_exactly_the_uninterrupted_samples(tmp_path: Path) -> None:
    per_step, replicas = 4, 2
    samples = per_step * replicas
    whole = _source(CORPUS, tmp_path, seq=16, seed=7)
    steps = 3 * whole.count // samples  # three epochs: resumes land mid-epoch and across epochs
    stream = [whole.batch(position=s * samples + r * per_step, sequences=per_step).inputs
              for s in range(steps) for r in range(replicas)]
    for stop in (1, whole.count // samples, whole.count // samples + 1, steps - 1):
        resumed = _source(CORPUS, tmp_path, seq=16, seed=7)  # a new process: the position alone
        position = stop * samples  # what the checkpoint of step `stop` records
        for s in range(stop, steps):
            for r in range(replicas):
                got = resumed.batch(position=position + r * per_step, sequences=per_step).inputs
                assert got.equal(stream[s * replicas + r]), f"resumed at step {stop}: step {s} replica {r}"
            position += samples


def _race(path: str, tokenizer: str, cache: str, queue: mp.Queue, start: mp.Barrier) -> None:
    start.wait(timeout=120)  # all three reach the cache together: without the lock each would tokenize
    queue.put(tokenized(path=path, tokenizer=tokenizer, cache_dir=cache).built)


def test_racing_processes_tokenize_once(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    queue, start = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_race, args=(str(CORPUS), str(TOKENIZER), str(tmp_path / "c"), queue, start))
             for _ in range(3)]
    for p in procs:
        p.start()
    built = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built) == [False, False, True]
    assert not [f for f in (tmp_path / "c").iterdir() if f.name.startswith(".")]  # no temporaries left


def test_bad_input_names_the_field(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    with pytest.raises(DataError, match=r"training\.data\.tokenizer: the tokenizer .* has 256 tokens but "
                                        r"the model's vocab_size is 100"):
        open_source(DataSpec(source="text", path=str(CORPUS), tokenizer=str(TOKENIZER), cache_dir=cache),
                    vocab_size=100, sequence_length=8, seed=0)
    assert not list((tmp_path / "cache").glob("*.u32"))  # refused before any tokenizing
    with pytest.raises(DataError, match=r"training\.data\.tokenizer is required for source text"):
        open_source(DataSpec(source="text", path=str(CORPUS)), vocab_size=256, sequence_length=8, seed=0)
    with pytest.raises(DataError, match=r"training\.data\.tokenizer: no tokenizer\.json at"):
        tokenized(path=str(CORPUS), tokenizer=str(tmp_path), cache_dir=cache)
    with pytest.raises(DataError, match=r"training\.data\.path: .*missing does not exist"):
        tokenized(path=str(tmp_path / "missing"), tokenizer=str(TOKENIZER), cache_dir=cache)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"training\.data\.path: .*bad\.jsonl line 2 has no string 'text'"):
        tokenized(path=str(bad), tokenizer=str(TOKENIZER), cache_dir=cache)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"training\.data\.path: .*latin\.txt is not UTF-8"):
        tokenized(path=str(latin), tokenizer=str(TOKENIZER), cache_dir=cache)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"training\.data\.path: .*mixed\.jsonl is not UTF-8 \(line 2, byte 13\)"):
        tokenized(path=str(mixed), tokenizer=str(TOKENIZER), cache_dir=cache)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match=r"training\.data\.path: .*empty\.jsonl holds no documents"):
        tokenized(path=str(empty), tokenizer=str(TOKENIZER), cache_dir=cache)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match=r"need at least sequenceLength \+ 1"):
        _source(short, tmp_path, seq=64)


def test_a_hugging_face_model_lends_its_tokenizer_and_eos(tmp_path: Path) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "tokenizer.json").write_bytes((TOKENIZER / "tokenizer.json").read_bytes())
    # No tokenizer_config.json here: the EOS comes from the model config's eos_token_id.
    hf = HuggingFaceModel(huggingface=HuggingFaceSpec(
        config={"model_type": "llama", "vocab_size": 256, "eos_token_id": 0}, weights=str(weights)))
    src = open_source(DataSpec(source="text", path=str(CORPUS), cache_dir=str(tmp_path / "c")), vocab_size=256,
                      sequence_length=16, seed=0, tokenizer_dirs=hf.file_dirs, model_eos=hf.eos_token_id)
    tokens = tokenized(path=str(CORPUS), tokenizer=str(weights), cache_dir=str(tmp_path / "c"), model_eos=0)
    assert isinstance(src, TextCorpus)
    assert [int(tokens.tokens[s - 1]) for s in tokens.document_starts[1:]] == [0] * 9  # EOS 0 ends each document


def test_the_shipped_tokenizer_is_what_its_script_trains(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tokenizer", REPO / "examples" / "data" / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (TOKENIZER / name).read_bytes(), f"{name}: rerun the script"
