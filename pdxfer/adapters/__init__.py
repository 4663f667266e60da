"""Engine adapters: code that runs in an engine's process (SGLang, vLLM) and speaks to
its node's daemon through the client, so the engine's schedulers drive pdxfer rooms
behind the engine's own transfer interface. Each adapter imports its engine (the user's
installation, never vendored). session.py is their shared session with the daemon,
cuda.py their shared CUDA IPC export, shm.py their shared move of CPU tensors into
shared memory."""
