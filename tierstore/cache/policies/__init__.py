"""Built-in eviction policies, one per module; importing this package registers them all."""

from tierstore.cache.policies import (  # noqa: F401  (imported to register)
    belady,
    class_lru,
    freq,
    freq_dense,
    lfu,
    lru,
    need,
    s3fifo,
    sieve,
    static_hot,
)
