"""KV movement kernels: paged cache <-> canonical pool blocks (``paged``), int8/fp8 transfer
compression (``quant``). Plain torch on CPU is the reference; on CUDA the Triton kernels
(``paged_triton``) run when triton is installed, else the same torch ops."""
