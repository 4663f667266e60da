"""The decode role (service.py), composed of named parts: requester.py, verifier.py, rotation.py; state.py what they share."""

from .service import DecodeService, bootstrap_endpoint

__all__ = ["DecodeService", "bootstrap_endpoint"]
