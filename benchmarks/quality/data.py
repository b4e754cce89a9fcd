"""Token windows: random training windows and the fixed validation windows every script shares."""

from __future__ import annotations

import numpy as np
import torch


def validation_windows(val_ids: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """int64 [n, seq_len]: the first n = min(count, len // seq_len) non-overlapping windows."""
    available = len(val_ids) // seq_len
    n = min(count, available)
    if n == 0:
        raise ValueError(f"validation split has {len(val_ids)} tokens, fewer than one window of {seq_len}")
    return torch.from_numpy(val_ids[: n * seq_len].astype(np.int64)).view(n, seq_len)


class WindowSampler:
    """Uniformly random windows of `seq_len` tokens from a token array, from a seeded generator."""

    def __init__(self, ids: np.ndarray, seq_len: int, batch_size: int, seed: int, device: torch.device):
        if len(ids) <= seq_len:
            raise ValueError(f"training split has {len(ids)} tokens, need more than seq_len={seq_len}")
        self.ids = torch.from_numpy(ids.astype(np.int64)).to(device)  # [N]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len, device=device)  # [L]

    def next(self) -> torch.Tensor:
        """int64 [batch_size, seq_len] on the sampler's device."""
        starts = torch.randint(0, len(self.ids) - self.seq_len + 1, (self.batch_size,), generator=self.generator)
        return self.ids[starts.to(self.ids.device)[:, None] + self.offsets]  # [B, L]


def prompt_set(tokenizer, texts: list[str], count: int, length: int) -> torch.Tensor:
    """int64 [n, length]: the fixed prompts, one per validation document in corpus order.

    A prompt is the first `length` tokens of the document from its first top-level `def ` or
    `class ` line (from the start when it has neither); documents shorter than that are skipped.
    """
    prompts = []
    for text in texts:
        starts = [i + 1 for i in (text.find("\ndef "), text.find("\nclass ")) if i >= 0]
        ids = tokenizer.encode(text[min(starts, default=0):], add_special_tokens=False).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError(f"no validation document has {length} tokens")
    return torch.tensor(prompts, dtype=torch.int64)


def leading_windows(tokenizer, texts: list[str], seq_len: int, count: int) -> torch.Tensor:
    """int64 [n <= count, seq_len]: consecutive windows over the first documents of `texts`."""
    from benchmarks.quality.tokenizer import encode_documents

    ids = encode_documents(tokenizer, [])
    for used in range(1, len(texts) + 1):
        ids = encode_documents(tokenizer, texts[:used])
        if len(ids) >= count * seq_len:
            break
    n = min(count, len(ids) // seq_len)
    if n == 0:
        raise ValueError(f"the documents hold {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.from_numpy(ids[: n * seq_len].astype(np.int64)).view(n, seq_len)
