"""GPU kernels (CUDA graphs, fused ops) go here, one module per kernel, each registered in kernels/registry.py
with the host needs (`cuda`, a compute capability) kernels/host.py probes. None yet: on a GPU every layer runs
transformers' own forward."""
