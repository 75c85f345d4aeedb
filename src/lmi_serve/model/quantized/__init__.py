"""Pre-quantized checkpoints (AWQ, GPTQ, compressed-tensors): recognised from config.json and unpacked.

- detect.py: `quantization_of(config)` -> `QuantFormat`, or a ModelLoadError naming what is not read.
- weights.py: `IntWeight`, the neutral int4/int8 weight every format unpacks into, and `dequantize`.
- awq.py, gptq.py, compressed.py: each format's packed tensors -> `IntWeight` (FP8 straight to floats).
- convert.py: the load-time fallback model/loader.py calls: a checkpoint dequantized once into a plain
  safetensors folder under the cache dir.

No kernels here: the int4 / int8 paths are to take `IntWeight`s; until then a checkpoint runs dequantized.
"""
