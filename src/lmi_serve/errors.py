"""Neutral error types. Each dialect maps them to its own status code and body shape."""

from __future__ import annotations


class ServingError(Exception):
    """Base class; `error_type` is stable and dialect mappers switch on it."""

    error_type = "ServingError"
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(ServingError):
    error_type = "BadRequestException"
    status = 400


class ModelNotFound(ServingError):
    error_type = "ModelNotFoundException"
    status = 404


class ModelNotReady(ServingError):
    """The model is still loading or failed to load."""

    error_type = "ServiceUnavailableException"
    status = 503


class Overloaded(ServingError):
    """The job queue is full."""

    error_type = "WlmCapacityException"
    status = 503


class RequestTimeout(ServingError):
    """The request waited longer than predict_timeout."""

    error_type = "TimeoutException"
    status = 504
