"""The prefill role (service.py), composed of named parts: writer.py, parts.py; state.py what they share."""

from .service import PrefillService

__all__ = ["PrefillService"]
