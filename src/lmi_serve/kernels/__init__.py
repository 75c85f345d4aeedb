"""What runs a layer's forward on this host: the probe (host.py), every kernel as data (registry.py), the
plan that applies the swaps in their order (plan.py), the module swaps (layers/) and the kernels (cpu/, cuda/).
The rule of this folder: it imports no engine, serving, server or dialect module (README.md)."""
