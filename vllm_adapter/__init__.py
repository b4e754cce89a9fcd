"""vLLM plugin for tierstore (installed as `tierstore.vllm_adapter`).

`register()` is the `vllm.general_plugins` entry point. vLLM calls it once in every process it
starts (front end, engine core, each worker); it is idempotent and cheap: importing this package
imports neither vLLM nor torch, and `register()` imports vLLM only to add the `tierstore`
quantization config.
"""

_registered = False


def register() -> None:
    """Make `--quantization tierstore` (and quant_method "tierstore" in a checkpoint) resolve to
    `TierstoreConfig`. Safe to call any number of times, in any process."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from tierstore.vllm_adapter.quant_config import QUANT_NAME, TierstoreConfig

    if QUANT_NAME not in QUANTIZATION_METHODS:
        register_quantization_config(QUANT_NAME)(TierstoreConfig)
    _registered = True
