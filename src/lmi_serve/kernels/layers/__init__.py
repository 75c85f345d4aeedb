"""The module swaps: `nn.Module`s of a loaded model replaced in place by ones that run the kernels (kernels/plan.py runs them in order)."""
