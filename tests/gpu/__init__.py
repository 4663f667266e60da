"""Tests that need a CUDA device: skipped, saying why, wherever none is visible (CI
and the CPU development hosts). A module's processes import tests.gpu.sides; nothing
here imports torch before a test asks."""


def cuda_missing() -> str:
    """Why the GPU tests cannot run here, or "" on a host with a visible CUDA device."""
    try:
        import torch
    except ImportError:
        return "torch is not installed; the GPU tests need torch with CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible; the GPU tests run on a GPU host only, never in CI"
    return ""
