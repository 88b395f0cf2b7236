"""Train the tiny BPE tokenizer of examples/data/tiny-tokenizer/ from examples/data/tiny-corpus/.

A 256-token BPE (the vocabulary of the tiny example models) with sentencepiece-style word
boundaries, so decoding gives the text back. Run from the repository root:

    python examples/data/make_tokenizer.py

It overwrites tokenizer.json and tokenizer_config.json (whose eos_token, </s>, separates the
documents when a job tokenizes the corpus); the committed files are its output. Training is
deterministic for the same corpus and tokenizers version (0.23.3, constraints.txt).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from adaptis.worker.data.corpus import corpus_files, read_documents

HERE = Path(__file__).resolve().parent
VOCAB = 256
UNK, EOS = "<unk>", "</s>"  # the special tokens: unknown piece, end of document
SPECIAL = [UNK, EOS]


def build(out: Path) -> Tokenizer:
    """Train the tokenizer on the tiny corpus and write its two files into ``out``."""
    out.mkdir(exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False)
    docs = list(read_documents(corpus_files(str(HERE / "tiny-corpus"))))
    tok.train_from_iterator(docs, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "unk_token": UNK, "tokenizer_class": "PreTrainedTokenizerFast"},
        indent=2) + "\n")
    return tok


def main() -> None:
    out = HERE / "tiny-tokenizer"
    tok = build(out)
    print(f"wrote {out}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
