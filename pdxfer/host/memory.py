"""Engine memory the daemon maps: CPU pools in POSIX shared memory (real here), GPU
pools by CUDA IPC handle and NPU pools by Ascend IPC key (written against the vendor
runtimes, loaded only when such a pool is registered).

Shared memory is opened through /dev/shm directly rather than
multiprocessing.shared_memory, whose resource tracker would unlink an engine's pool
when the daemon that merely mapped it exits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import secrets
import sys
import threading

import numpy as np

from ..core.errors import BadMessage, InsufficientCapacity, Unsupported
from ..core.paths import device_kind
from ..core.protocol import CudaIpcHandle, MemoryHandle, NpuIpcHandle, ShmHandle

SHM_DIR = "/dev/shm"
KV_POOL_PREFIX, AUX_BUFFER_PREFIX = "pdxfer-kv", "pdxfer-aux"  # engines' shared memory is named PREFIX-PID-HEX
# Fault the pages in at map time rather than inside the first transfers.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
# Where a daemon whose transfer engine runs in a process of its own maps host memory
# (place_mappings_apart): that process maps the same memory at the same addresses
# (transport/engine_process.py), so both must have them free. The kernel places mappings
# top-down from just under the stack (0x7f.. here); 32-64 TiB is far below, where
# neither process puts anything of its own. Left to the kernel, the daemon's pools
# landed on one of the engine process's own mappings about once in 3,000 registrations.
APART = (0x2000_0000_0000, 0x4000_0000_0000)
_APART_ALIGN = 2 << 20
_placement: "AddressRange | None" = None


class AddressRange:
    """Hands out aligned, never-overlapping address ranges; a range given back is
    handed out again for a mapping of the same size."""

    def __init__(self, start: int, end: int) -> None:
        self._next, self._end = start, end
        self._free: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> int:
        span = -(-size // _APART_ALIGN) * _APART_ALIGN
        with self._lock:
            if self._free.get(span):
                return self._free[span].pop()
            if self._next + span > self._end:
                raise InsufficientCapacity(f"no room left to map {size} more bytes at fixed addresses")
            address, self._next = self._next, self._next + span + _APART_ALIGN  # a guard gap between mappings
            return address

    def give(self, address: int, size: int) -> None:
        span = -(-size // _APART_ALIGN) * _APART_ALIGN
        with self._lock:
            self._free.setdefault(span, []).append(address)


def place_mappings_apart() -> None:
    """From now on, shared memory this process maps goes in APART (see there)."""
    global _placement
    if _placement is None:
        _placement = AddressRange(*APART)


class _FixedMapping:
    """Shared memory mapped at an address of ours (mmap.mmap cannot be told one)."""

    def __init__(self, fd: int, size: int, placement: AddressRange, flags: int = _MAP_FLAGS) -> None:
        self.size, self.placement = size, placement
        for _ in range(8):  # an address taken after all (something else mapped there) is skipped
            address = placement.take(size)
            got = libc().mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags | MAP_FIXED_NOREPLACE, fd, 0)
            if got == address:
                self.address, self.closed = address, False
                return
            if got != MAP_FAILED:  # a kernel before 4.17 took the address as a hint
                libc().munmap(got, size)
        raise Unsupported(f"cannot map {size} bytes of shared memory at a fixed address ({os.strerror(ctypes.get_errno())})")

    def buffer(self):
        self._buffer = (ctypes.c_uint8 * self.size).from_address(self.address)
        return self._buffer

    def close(self) -> None:
        if self.closed:
            return
        if sys.getrefcount(self._buffer) > 2:  # a view of it is alive: unmapping would pull the memory from under it
            raise BufferError("views of the mapping are still alive")
        self.closed = True
        libc().munmap(self.address, self.size)
        self.placement.give(self.address, self.size)


MAP_FIXED_NOREPLACE = 0x100000  # Linux 4.17+: fail with EEXIST rather than replace what is there
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in for writing now; the bytes stay as they are


def _prefault(address: int, length: int) -> bool:
    """Map [address, +length) of this process's shared memory, whose file already has
    the pages (SharedMemory.reserve), for writing now, the bytes untouched; False on
    a kernel before 5.14."""
    start = address - address % mmap.PAGESIZE
    return libc().madvise(start, address + length - start, MADV_POPULATE_WRITE) == 0


@functools.lru_cache(maxsize=1)
def libc():
    """libc with mmap and munmap typed: mmap.mmap cannot be told an address."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _map(fd: int, size: int, populate: bool = True):
    flags = _MAP_FLAGS if populate else _MAP_FLAGS & ~getattr(mmap, "MAP_POPULATE", 0)
    if _placement is not None:
        return _FixedMapping(fd, size, _placement, flags)
    return mmap.mmap(fd, size, flags=flags)


class SharedMemory:
    """A shared-memory object mapped read-write into this process."""

    def __init__(self, name: str, size: int, mapping, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap = mapping  # an mmap.mmap, or a _FixedMapping
        self.identity = (0, 0)  # (device, inode) of the file it maps
        self.array = np.frombuffer(mapping.buffer() if isinstance(mapping, _FixedMapping) else mapping, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)

    @classmethod
    def create(cls, size: int, prefix: str = "pdxfer", populate: bool = True) -> "SharedMemory":
        """``populate`` false: pages come in as they are first used (a buffer that may stay mostly idle)."""
        name, fd = new_file(size, prefix)
        try:
            mapping = _map(fd, size, populate)
            identity = _identity(os.fstat(fd))
        finally:
            os.close(fd)
        made = cls(name, size, mapping, owner=True)
        made.identity = identity
        return made

    @classmethod
    def open(cls, name: str, size: int) -> "SharedMemory":
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise BadMessage(f"shared memory {name!r} does not exist under {SHM_DIR}") from None
        except OSError as exc:
            raise BadMessage(f"cannot open shared memory {name!r}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < size:
                raise BadMessage(f"shared memory {name!r} has {st.st_size} bytes, but {size} were declared")
            mapping = _map(fd, size)
        finally:
            os.close(fd)
        opened = cls(name, size, mapping, owner=False)
        opened.identity = _identity(st)
        return opened

    def reserve(self, offset: int, nbytes: int) -> None:
        """Back [offset, offset + nbytes) with pages now, for memory created without
        them: a page first touched once the filesystem is full ends its toucher with
        SIGBUS, whereas this raises InsufficientCapacity (nothing of the range is kept)."""
        try:  # by its name: the descriptor was closed once mapped (an operator may have removed the name since)
            fd = os.open(os.path.join(SHM_DIR, self.name), os.O_RDWR)
            try:
                os.posix_fallocate(fd, offset, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            raise InsufficientCapacity(f"{SHM_DIR} cannot back {nbytes} more bytes of {self.name} ({exc.strerror})") from None

    def populate(self) -> str:
        """Back every page now (reserve) and map them here, so that the thread that
        first writes one takes no page fault, for memory created without them; "" when
        done, else why not (nothing is kept where /dev/shm cannot hold it)."""
        try:
            self.reserve(0, self.size)
        except InsufficientCapacity as exc:
            return exc.message
        if not _prefault(self.address, self.size):
            self.array[:: mmap.PAGESIZE].max()  # before Linux 5.14: reading maps a page of shared memory writable too
        return ""

    @property
    def handle(self) -> ShmHandle:
        return ShmHandle(name=self.name, size=self.size)

    def close(self) -> None:
        if self._mmap.closed:
            return
        self.array = None  # drop our export so the mapping can close
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view is still alive somewhere; the mapping goes when it does
        if self.owner:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def same_memory(handle: MemoryHandle, mapping) -> bool:
    """Whether ``mapping``, made for ``handle``, still maps what the handle names now. An
    engine that restarts may create its shared memory again under the same name: that
    is new memory, which the old mapping does not see. A device handle names its
    allocation (a new one gets a new handle)."""
    if not isinstance(handle, ShmHandle):
        return True
    try:
        return _identity(os.stat(os.path.join(SHM_DIR, handle.name))) == mapping.identity
    except OSError:
        return False


def new_file(size: int, prefix: str) -> tuple[str, int]:
    """A new shared-memory file of ``size`` bytes, named ``PREFIX-PID-HEX`` (so that
    find_orphans sees it once this process is gone), and its open descriptor. Orphans
    of ``prefix`` are swept first; a size that does not fit is refused."""
    sweep_orphans((prefix,))
    room = room_for_pools()
    if size > room:  # refused now: a pool faulted in past this ends in SIGBUS or the OOM killer
        raise InsufficientCapacity(
            f"a {size}-byte pool does not fit in shared memory: {room} bytes left "
            f"({SHM_DIR} free space or the memory available, whichever is less)"
        )
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(SHM_DIR, name))
        raise
    return name, fd


def available_memory() -> int | None:
    """Bytes of memory the kernel reports available (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def room_for_pools(path: str = SHM_DIR) -> int:
    """Bytes new pools can still take: the shared-memory filesystem's free space, or the
    memory the kernel reports available when that is less (tmpfs pages are RAM)."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    available = available_memory()
    return free if available is None else min(free, available)


def find_orphans(prefixes: tuple[str, ...] = (KV_POOL_PREFIX, AUX_BUFFER_PREFIX)) -> dict[str, int]:
    """Shared memory named ``PREFIX-PID-HEX`` whose creating process is gone (an engine
    killed before it could clean up), with the size of each."""
    found = {}
    for name in os.listdir(SHM_DIR):
        parts = name.rsplit("-", 2)
        if len(parts) != 3 or parts[0] not in prefixes or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            try:
                found[name] = os.path.getsize(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass  # removed meanwhile
        except PermissionError:
            pass  # alive, someone else's
    return found


def mapped_after_unlink(prefixes: tuple[str, ...] = (KV_POOL_PREFIX, AUX_BUFFER_PREFIX), proc: str = "/proc") -> dict[int, int]:
    """Bytes of pdxfer shared memory each process maps whose name is gone from /dev/shm:
    pid -> bytes. A daemon keeps the pools of an engine that exited mapped (the engine
    unlinked them, or the next sweep did) until the engine registers new ones or the
    daemon stops, so they hold memory that no listing of /dev/shm shows. Processes
    whose maps cannot be read (another user's) are left out."""
    marks = tuple(f"{SHM_DIR}/{prefix}-" for prefix in prefixes)
    held = {}
    for pid in filter(str.isdigit, os.listdir(proc)):
        spans: dict[str, int] = {}
        try:
            with open(os.path.join(proc, pid, "maps")) as fh:
                for line in fh:
                    if line.endswith(" (deleted)\n") and any(mark in line for mark in marks):
                        span, _, _, _, inode = line.split(None, 5)[:5]
                        start, end = (int(x, 16) for x in span.split("-"))
                        spans[inode] = spans.get(inode, 0) + end - start  # one pool may be several mappings
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if spans:
            held[int(pid)] = sum(spans.values())
    return held


def sweep_orphans(prefixes: tuple[str, ...] = (KV_POOL_PREFIX, AUX_BUFFER_PREFIX)) -> dict[str, int]:
    """Unlink what find_orphans finds; returns the size of each name removed. A daemon
    that still maps one keeps its mapping; only the name goes."""
    removed = {}
    for name, size in find_orphans(prefixes).items():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed[name] = size
        except FileNotFoundError:
            pass  # another sweeper took it first
    return removed


def _load(library: str, hint: str) -> ctypes.CDLL:
    path = ctypes.util.find_library(library)
    if path is None:
        raise Unsupported(f"lib{library} is not on this host: {hint}")
    return ctypes.CDLL(path)


class CudaIpcMemory:
    """A GPU pool opened with cudaIpcOpenMemHandle: the whole cudaMalloc block the
    engine exported (adapters/cuda.py), mapped at ``address``. Regions lie at offsets
    inside it; ``size`` is what the engine said the daemon may touch."""

    class _Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    def __init__(self, handle: CudaIpcHandle) -> None:
        if len(handle.handle) != ctypes.sizeof(self._Handle):
            # torch's own sharing bytes carry a version and a type byte first: adapters/cuda.py takes them off
            raise BadMessage(f"a cuda_ipc handle is the {ctypes.sizeof(self._Handle)} bytes of a cudaIpcMemHandle_t, not {len(handle.handle)}")
        self._cudart = _load("cudart", "GPU pools need the CUDA runtime and a visible GPU")
        self._cudart.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), self._Handle, ctypes.c_uint]
        self._cudart.cudaGetErrorString.restype = ctypes.c_char_p
        raw = self._Handle.from_buffer_copy(handle.handle)
        pointer = ctypes.c_void_p()
        rc = self._cudart.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, 1)  # 1: cudaIpcMemLazyEnablePeerAccess
        if rc != 0:
            reason = self._cudart.cudaGetErrorString(rc).decode()
            raise Unsupported(f"cudaIpcOpenMemHandle failed on device {handle.device}: CUDA error {rc} ({reason})")
        self.address = int(pointer.value)
        self.size = handle.size

    def close(self) -> None:
        self._cudart.cudaIpcCloseMemHandle(ctypes.c_void_p(self.address))


class CudaIpcEvent:
    """A CUDA event another process recorded and exported (cudaIpcGetEventHandle),
    opened here on the thread the device is current on: ``done()`` says whether the work
    before it completed, without blocking."""

    class _Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

    NOT_READY = 600  # cudaErrorNotReady

    def __init__(self, handle: bytes) -> None:
        if len(handle) != ctypes.sizeof(self._Handle):
            raise BadMessage(f"a CUDA event handle is the {ctypes.sizeof(self._Handle)} bytes of a cudaIpcEventHandle_t, not {len(handle)}")
        self._cudart = _load("cudart", "a send() with a CUDA event needs the CUDA runtime and a visible GPU (--device cuda:N)")
        self._cudart.cudaIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), self._Handle]
        self._cudart.cudaEventQuery.argtypes = [ctypes.c_void_p]
        self._cudart.cudaEventDestroy.argtypes = [ctypes.c_void_p]
        self._cudart.cudaGetErrorString.restype = ctypes.c_char_p
        self._event = ctypes.c_void_p()
        self._check(self._cudart.cudaIpcOpenEventHandle(ctypes.byref(self._event), self._Handle.from_buffer_copy(handle)), "cudaIpcOpenEventHandle")

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise Unsupported(f"{call} failed: CUDA error {rc} ({self._cudart.cudaGetErrorString(rc).decode()})")

    def done(self) -> bool:
        rc = self._cudart.cudaEventQuery(self._event)
        if rc == self.NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def close(self) -> None:
        self._cudart.cudaEventDestroy(self._event)


class NpuIpcMemory:
    """An NPU pool imported with aclrtIpcMemImportByKey."""

    def __init__(self, handle: NpuIpcHandle) -> None:
        self._acl = _load("ascendcl", "NPU pools need Ascend CANN and a visible NPU")
        pointer = ctypes.c_void_p()
        rc = self._acl.aclrtIpcMemImportByKey(ctypes.byref(pointer), ctypes.c_char_p(handle.handle), ctypes.c_uint64(0))
        if rc != 0:
            raise Unsupported(f"aclrtIpcMemImportByKey failed with ACL error {rc} on device {handle.device}")
        self.address = int(pointer.value)
        self.size = handle.size
        self._key = handle.handle

    def close(self) -> None:
        self._acl.aclrtIpcMemClose(ctypes.c_char_p(self._key))


def open_handle(handle: MemoryHandle):
    if isinstance(handle, ShmHandle):
        return SharedMemory.open(handle.name, handle.size)
    if isinstance(handle, CudaIpcHandle):
        return CudaIpcMemory(handle)
    return NpuIpcMemory(handle)


def bind_device(device: str) -> None:
    """D1: make ``device`` current in this process before any transport starts.
    Uses the vendor runtime directly, so the daemon never needs torch."""
    kind = device_kind(device)
    if kind == "cpu":
        return
    index = int(device.split(":", 1)[1])
    if kind == "cuda":
        cudart = _load("cudart", f"--device {device} needs the CUDA runtime and a visible GPU")
        rc = cudart.cudaSetDevice(ctypes.c_int(index))
        if rc != 0:
            raise Unsupported(f"cudaSetDevice({index}) failed with CUDA error {rc}: is GPU {index} visible?")
        return
    acl = _load("ascendcl", f"--device {device} needs Ascend CANN (libascendcl) and a visible NPU")
    rc = acl.aclrtSetDevice(ctypes.c_int32(index))
    if rc != 0:
        raise Unsupported(f"aclrtSetDevice({index}) failed with ACL error {rc}: is NPU {index} visible?")
