"""The reference engine: a small Llama-style model over a paged KV cache (``model``), continuous
batching with pool-backed prefix reuse and prefill/decode roles (``engine``), worker processes
(``worker``) and cost-model profiling (``profile``)."""
