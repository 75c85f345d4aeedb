"""The numba CPU kernels: each compiled once (`numba_bits.CompiledOnce`) and reached through `kernel()`."""
