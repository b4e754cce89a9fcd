"""Token chunks of a batch whose routed experts outnumber the device pool (`token_chunks`)."""

from __future__ import annotations


def token_chunks(topk_ids: list[list[int]], slots: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges, in order, each routing at most `slots` distinct experts (greedy; a token routing
    more than `slots` alone is its own range, which the fetch then refuses). How a layer whose batch routes more
    experts than the device pool holds runs (a prefill; every decode step the start-up check admits fits): each
    chunk's experts fetched, then computed (`TieredRuntime.moe` in a prefill step, the vLLM adapter's eager layers).
    Not bit-identical to the unchunked batch: a chunk's GEMMs run over fewer tokens and round differently, and on
    CUDA moe_mm may pick another block size for it."""
    chunks, start, seen = [], 0, set()
    for index, experts in enumerate(topk_ids):
        if len(seen | set(experts)) > slots and index > start:
            chunks.append((start, index))
            start, seen = index, set()
        seen |= set(experts)
    chunks.append((start, len(topk_ids)))
    return chunks
