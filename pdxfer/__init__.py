"""pdxfer: ship KV cache and aux metadata from prefill to decode workers."""

__version__ = "0.1.0"
