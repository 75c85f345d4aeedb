"""lmi-serve: a SageMaker/LMI-style LLM serving container on transformers, Flask and gunicorn."""

from lmi_serve.handler_api import Input, Output, input_formatter, output_formatter

__version__ = "0.1.0"
__all__ = ["Input", "Output", "input_formatter", "output_formatter", "__version__"]
