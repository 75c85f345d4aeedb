"""Triton's example model `simple`, written as an lmi-serve tensor model (docs/triton.md, "Tensor models").

OUTPUT0 = INPUT0 + INPUT1 and OUTPUT1 = INPUT0 - INPUT1, element-wise, for INT32 tensors of shape
[-1, 16]. The server has already checked names, datatypes and shapes against INPUT_TENSORS before
handle() runs, so the arithmetic is all that is left.
"""

from lmi_serve import Input, Output
from lmi_serve.tensor_model import TensorSpec, add_tensors, get_tensors

INPUT_TENSORS = [TensorSpec("INPUT0", "INT32", [-1, 16]), TensorSpec("INPUT1", "INT32", [-1, 16])]
OUTPUT_TENSORS = [TensorSpec("OUTPUT0", "INT32", [-1, 16]), TensorSpec("OUTPUT1", "INT32", [-1, 16])]


def handle(inputs: Input) -> Output | None:
    if inputs.is_empty():  # the first call carries the model's options; there is nothing to load
        return None
    output = Output()
    for index, item in enumerate(inputs.get_batches()):  # several requests when batch_size > 1
        tensors = get_tensors(item)
        first, second = tensors["INPUT0"], tensors["INPUT1"]
        add_tensors(output, {"OUTPUT0": first + second, "OUTPUT1": first - second},
                    batch_index=index if inputs.is_batch() else None)
    return output
