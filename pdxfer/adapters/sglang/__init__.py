"""pdxfer as an SGLang PD transfer backend (``--disaggregation-transfer-backend pdxfer``).

SGLang loads ``plugin.register`` through its ``sglang.srt.plugins`` entry point (the
``pdxfer[sglang]`` extra); ``conn`` holds the backend's classes, ``layout`` turns SGLang's
KV description into a pdxfer registration, ``places`` makes the KV pool reachable by the
daemon (shared memory on CPU, CUDA IPC on GPU). ENGINES.md §1-§3 and §7.B are the design.
"""
