"""A stand-in for torchvision in the engine test environment (`make engines-env`).

SGLang, vLLM and transformers import torchvision at module level in their image code,
which the text-only test model never runs. PyPI's torchvision wheels are built against
a CUDA torch, so the environment gets this stub instead: every ``torchvision.*``
module imports, every name in it resolves, and calling anything raises."""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _UnavailableMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{cls.__name__}.{name}", cls.__module__)


class Unavailable(metaclass=_UnavailableMeta):
    """A name the stub does not define: it can be subclassed, annotated with and read
    attributes from; calling it raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__module__}.{type(self).__name__}: torchvision is a stub "
            "in the engine test environment (tests/engines/stubs/torchvision)"
        )


def _unavailable(name: str, module: str) -> type:
    return _UnavailableMeta(name, (Unavailable,), {"__module__": module})


def _module_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        if name == "InterpolationMode":
            return InterpolationMode
        return _unavailable(name, module)

    return __getattr__


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr(__name__)
