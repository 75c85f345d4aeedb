"""The tensor-model surface's former address, so model.py files written against it keep working.
It lives in `lmi_serve.tensor_model` now, beside the handler API: the serving layer reads a tensor
model's declarations when it loads one, and the Triton dialect serves it."""

from lmi_serve.tensor_model import TensorSpec, add_tensors, get_tensors

__all__ = ["TensorSpec", "add_tensors", "get_tensors"]
