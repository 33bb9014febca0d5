"""Engine connectors: transformers (``hf``), vLLM (``vllm``), SGLang (``sglang``), the pool
interface they use (``pool_api``) and int8/fp8 compression in front of it (``compressed_pool``).
Engine packages are imported lazily, inside the functions that need them."""
