"""Offline inputs for the real torchtitan run: a word-level tokenizer and a JSONL text corpus, made here.

torchtitan's debug config points at `./tests/assets/tokenizer` and the `c4_test` dataset, both files of its
git repository that the PyPI wheel does not ship, and the machine has no hub access. A tokenizer of 500
words plus BOS/EOS (ids below the debug model's vocabulary of 2048) and a seeded corpus of those words are
enough: the run exercises torchtitan's real tokenizer loader (`HuggingFaceTokenizer`, `tokenizer.json` +
`tokenizer_config.json`) and its real dataset path (`--dataloader.dataset_path` of a local JSONL dir).
Imported only by the real-client tier (it needs the `tokenizers` package torchtitan depends on).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

__all__ = ["write_titan_assets"]

_WORDS = [f"w{i}" for i in range(500)]


def write_titan_assets(root: Path, *, documents: int = 400, seed: int = 0) -> tuple[Path, Path]:
    """Write `root/tokenizer/` and `root/data/train.jsonl`; return (tokenizer dir, dataset dir)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_dir, data_dir = root / "tokenizer", root / "data"
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    # torchtitan reads BOS/EOS from here (HuggingFaceTokenizer._infer_special_tokens)
    (tok_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    rng = random.Random(seed)
    with open(data_dir / "train.jsonl", "w") as f:
        for _ in range(documents):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 120)))
            f.write(json.dumps({"text": words}) + "\n")
    return tok_dir, data_dir
