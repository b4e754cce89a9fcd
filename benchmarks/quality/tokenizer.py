"""A byte-level BPE tokenizer trained offline with the `tokenizers` library, saved in HF format.

Byte-level means every UTF-8 byte has a token, so any text round-trips. Training is
deterministic for a given corpus and vocabulary size (checked by `tokenizer_hash` in the tests).
Documents are joined with the end-of-text token when a split is encoded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

END_OF_TEXT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (END_OF_TEXT, PAD)  # ids 0 and 1


def train_tokenizer(texts: list[str], vocab_size: int):
    """tokenizers.Tokenizer: byte-level BPE with `vocab_size` entries, special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def tokenizer_hash(tokenizer) -> str:
    """SHA-256 of the tokenizer's canonical JSON."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def save_hf_tokenizer(tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json + tokenizer_config.json that `AutoTokenizer.from_pretrained` loads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   pad_token=PAD, model_max_length=model_max_length)
    fast.save_pretrained(str(out_dir))


def load_tokenizer_file(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def encode_documents(tokenizer, texts: list[str]) -> np.ndarray:
    """uint16 [tokens]: every document's ids followed by the end-of-text id."""
    if tokenizer.get_vocab_size() > 2**16:
        raise ValueError("vocabulary too large for uint16 token arrays")
    eos = tokenizer.token_to_id(END_OF_TEXT)
    pieces = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.asarray(encoding.ids, dtype=np.uint16))
        pieces.append(np.asarray([eos], dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)
