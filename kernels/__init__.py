"""KV movement kernels: paged cache <-> canonical pool blocks (``paged``), int8/fp8 transfer
compression (``quant``). Plain torch: the CPU run is the reference; CUDA tensors run the same ops."""
