"""pdxfer as an SGLang PD transfer backend (``--disaggregation-transfer-backend pdxfer``).

SGLang loads ``plugin.register`` through its ``sglang.srt.plugins`` entry point (the
``pdxfer[sglang]`` extra); ``conn`` holds the backend's classes, ``layout`` turns SGLang's
KV description into a pdxfer registration, ``places`` makes the KV pool reachable by the
daemon (shared memory on CPU, CUDA IPC on GPU). docs/engines.md §G1-G3, B1-B7 are the design.
"""
