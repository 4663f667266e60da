"""Engine adapters: code that runs in an engine's process (SGLang, vLLM) and speaks to
its node's daemon through the client. cuda.py is their shared CUDA IPC export."""
