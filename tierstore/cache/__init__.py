"""Cache-side building blocks: eviction policies, slot tables and the pinned host arena."""
