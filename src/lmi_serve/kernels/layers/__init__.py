"""The module swaps: a loaded model's `nn.Module`s replaced in place by ones that run the kernels, in the order
`kernels/plan.py` runs them."""
