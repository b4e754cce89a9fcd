"""vLLM plugin for tierstore (installed as `tierstore.vllm_adapter`).

`register()` is the `vllm.general_plugins` entry point: idempotent, and it imports vLLM lazily.
"""

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
