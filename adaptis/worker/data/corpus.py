"""A local text corpus tokenized once into a cached token file, with the model's tokenizer.

Sits under :mod:`adaptis.worker.data.sources`, whose
:class:`~adaptis.worker.data.sources.TextCorpus` reads the cache this module writes. The corpus is
UTF-8 text files (one document each) or JSONL files (one document per line, its ``text`` field);
documents are encoded with a ``tokenizer.json`` (the ``tokenizers`` package; nothing is downloaded)
and joined with the tokenizer's EOS id after each document.

The cache is a flat uint32 token file, the documents' start offsets (int64 ``.npy``) and a JSON
index (files, documents, tokens, the EOS id), written last, all named by a hash of the corpus
files' bytes and of the tokenizer: an edited file or another tokenizer makes a new cache entry,
never a stale read.

Who tokenizes: every rank that needs data calls :func:`tokenized`; the first one to take an
exclusive ``flock`` on the cache's lock file tokenizes and publishes atomically (temporary files,
fsync, ``os.replace``, the index last), the others block on the lock and then find the index.
A lock rather than a ``torch.distributed`` barrier because only the first and last pipeline
ranks read data (a barrier would make the middle ranks wait for a collective they have no part
in) and because tokenizing a big corpus may outlast the process group's timeout. Ranks in other
pods with their own cache directory tokenize the same bytes with the same tokenizer into the same
ids: encoding is deterministic, so no rank needs another's cache.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adaptis.worker.errors import DataError

__all__ = ["CACHE_VERSION", "Tokenized", "corpus_files", "load_tokenizer", "read_documents", "tokenized"]

log = logging.getLogger(__name__)

# Bump when the cache's layout or the tokenizing rules change: the key includes it.
CACHE_VERSION = 2
_TEXT_SUFFIXES = (".txt", ".text", ".md", ".jsonl")
_BATCH_DOCUMENTS = 256
_FIELD = "training.data"


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A published cache: ``tokens`` (uint32, memory-mapped) and what its index says."""

    tokens: np.ndarray
    document_starts: np.ndarray  # int64, one per document: its first token's offset
    eos_id: int
    vocab_size: int
    key: str
    built: bool  # this call tokenized the corpus (False: another process had, or an earlier run)


def corpus_files(path: str) -> list[Path]:
    """The corpus's files in a fixed order: the file itself, a directory's text and JSONL files
    (recursively, sorted), or a glob's matches (sorted)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in _TEXT_SUFFIXES)
        if not found:
            raise DataError(f"{_FIELD}.path: directory {p} holds no {', '.join(_TEXT_SUFFIXES)} files")
        return found
    if glob.has_magic(path):
        found = sorted(Path(m) for m in glob.glob(path, recursive=True) if Path(m).is_file())
        if not found:
            raise DataError(f"{_FIELD}.path: glob {path} matches no files")
        return found
    raise DataError(f"{_FIELD}.path: {p} does not exist; give a text or JSONL file, a directory "
                    "or a glob inside the pod (a volume)")


def read_documents(files: list[Path]) -> Iterator[str]:
    """The corpus's documents in order: a text file whole, a JSONL file's ``text`` per line (read
    line by line: a JSONL corpus may be far bigger than memory)."""
    for f in files:
        if f.suffix.lower() != ".jsonl":
            yield _utf8(f.read_bytes(), file=f, where="byte")
            continue
        with open(f, "rb") as lines:
            for number, raw in enumerate(lines, start=1):
                line = _utf8(raw, file=f, where=f"line {number}, byte")
                if line.strip():
                    yield _jsonl_text(line, file=f, number=number)


def _utf8(raw: bytes, *, file: Path, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{_FIELD}.path: {file} is not UTF-8 ({where} {err.start}); convert it or "
                        "leave it out of the corpus") from None


def _jsonl_text(line: str, *, file: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{_FIELD}.path: {file} line {number} is not JSON: {err.msg}") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise DataError(f"{_FIELD}.path: {file} line {number} has no string 'text' field; "
                        'each JSONL line must be an object like {"text": "..."}')
    return record["text"]


def _file_digest(path: Path) -> bytes:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def load_tokenizer(path: str, *, model_eos: int | None = None) -> tuple[Any, int, bytes]:
    """``(tokenizer, eos_id, tokenizer.json bytes)`` from a tokenizer.json or a directory holding
    one. The EOS token is ``eos_token`` of a ``tokenizer_config.json`` beside it, else the model
    config's ``eos_token_id`` (``model_eos``)."""
    from tokenizers import Tokenizer  # the worker extra: the api and planner never import it

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise DataError(f"{_FIELD}.tokenizer: no tokenizer.json at {p}; give a tokenizer.json or a "
                        "directory holding one (a fast tokenizer's save_pretrained writes it)")
    raw = file.read_bytes()
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise DataError(f"{_FIELD}.tokenizer: {file} is not a tokenizers JSON file: {err}") from None
    eos_id = _eos_id(tok, config=file.parent / "tokenizer_config.json", model_eos=model_eos)
    return tok, eos_id, raw


def _eos_id(tok: Any, *, config: Path, model_eos: int | None) -> int:
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):  # older configs store an AddedToken's fields
            eos = eos.get("content")
        if isinstance(eos, str):
            found = tok.token_to_id(eos)
            if found is None:
                raise DataError(f"{_FIELD}.tokenizer: {config} names eos_token {eos!r}, which the "
                                "tokenizer's vocabulary lacks")
            return int(found)
    if model_eos is not None:
        return model_eos
    raise DataError(f"{_FIELD}.tokenizer: no EOS token to separate documents: put a "
                    "tokenizer_config.json with eos_token beside tokenizer.json, or give the "
                    "model config's eos_token_id")


def tokenized(*, path: str, tokenizer: str, cache_dir: str | None, model_eos: int | None = None,
              vocab_size: int | None = None) -> Tokenized:
    """The corpus's tokens, from the cache, tokenizing first if no rank has yet (see the module
    docstring for who tokenizes and why). ``vocab_size``: the model's, which the tokenizer's
    vocabulary must fit (checked before any tokenizing)."""
    files = corpus_files(path)
    tok, eos_id, raw = load_tokenizer(tokenizer, model_eos=model_eos)
    size = int(tok.get_vocab_size(with_added_tokens=True))
    if vocab_size is not None and size > vocab_size:
        raise DataError(f"{_FIELD}.tokenizer: the tokenizer {tokenizer} has {size} tokens but the "
                        f"model's vocab_size is {vocab_size}: use the model's own tokenizer, or a "
                        "model whose vocab_size covers the tokenizer")
    digest = hashlib.sha256(f"adaptis-corpus-v{CACHE_VERSION} eos={eos_id}\n".encode())
    digest.update(hashlib.sha256(raw).digest())
    for f in files:
        digest.update(_file_digest(f))
        digest.update(f.suffix.lower().encode())  # JSONL and text read the same bytes differently
    key = digest.hexdigest()[:32]
    root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "adaptis-data"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(f"{_FIELD}.cacheDir: cannot create {root}: {err.strerror}; give a writable "
                        "directory") from None
    index = root / f"{key}.json"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held until the with block: the others wait here
        built = not index.is_file()
        if built:
            _tokenize(files, tok=tok, eos_id=eos_id, root=root, key=key)
    meta = json.loads(index.read_text())
    if not meta["documents"]:
        raise DataError(f"{_FIELD}.path: {path} holds no documents (empty files or JSONL lines only)")
    tokens = np.memmap(root / f"{key}.u32", dtype=np.uint32, mode="r")
    starts = np.load(root / f"{key}.docs.npy", mmap_mode="r")
    assert len(starts) == meta["documents"]  # the index is written last: both files are whole
    return Tokenized(tokens=tokens, document_starts=starts, eos_id=eos_id,
                     vocab_size=size, key=key, built=built)


def _tokenize(files: list[Path], *, tok: Any, eos_id: int, root: Path, key: str) -> None:
    started = time.perf_counter()
    starts: list[int] = []
    count = 0
    fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=".u32")
    try:
        with os.fdopen(fd, "wb") as out:
            batch: list[str] = []

            def flush() -> None:
                nonlocal count
                for enc in tok.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray([*enc.ids, eos_id], dtype=np.uint32)
                    starts.append(count)
                    count += len(ids)
                    ids.tofile(out)
                batch.clear()

            for doc in read_documents(files):
                batch.append(doc)
                if len(batch) >= _BATCH_DOCUMENTS:
                    flush()
            flush()
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, root / f"{key}.u32")
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(starts, dtype=np.int64))
        _write_atomic(root / f"{key}.docs.npy", buffer.getvalue())
        meta = {"version": CACHE_VERSION, "files": [str(f) for f in files], "documents": len(starts),
                "tokens": count, "eos_id": eos_id}
        _write_atomic(root / f"{key}.json", json.dumps(meta).encode())
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("tokenized %d documents of %d files into %d tokens in %.2f s (cache %s)", len(starts),
             len(files), count, time.perf_counter() - started, root / key)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
