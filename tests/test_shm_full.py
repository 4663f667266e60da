"""/dev/shm filling up after the daemons started, on a real tmpfs with real daemons and
Mooncake. A daemon's staging buffer is created without pages (an idle daemon's takes no
memory), so a page of it first written once the filesystem is full cannot be had: a
prefill gathering a leg's token-major slices into one used to die of SIGBUS there, and
with it every room on the node. Now each extent is backed before it is handed out, and
one that cannot be is refused: that chunk writes between the pages, and rooms succeed.

Runs ``pdxfer bench`` in a mount namespace of its own whose /dev/shm is a tmpfs just
larger than the staging buffer, which the bench's pools then nearly fill. Needs root
and util-linux's unshare."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys

import pytest

from pdxfer.core.errors import InsufficientCapacity
from pdxfer.core.staging import staging_mib
from pdxfer.host import memory as host_memory
from pdxfer.host.memory import SHM_DIR, SharedMemory

from .conftest import needs_mooncake


def _unavailable() -> str:
    if os.geteuid() != 0:
        return "mounting a small /dev/shm in a mount namespace needs root"
    if shutil.which("unshare") is None:
        return "util-linux's unshare is not installed"
    return ""


SHM_MIB = staging_mib("tcp") + 88  # the prefill's buffer must fit at its start; the pools then take all but ~8 MiB
ROOMS = 29  # of 4-16 MiB at 1:2: 580 MiB of source and destination pools


@needs_mooncake
@pytest.mark.integration
@pytest.mark.skipif(bool(_unavailable()), reason=_unavailable() or "-")
def test_a_full_dev_shm_makes_a_gathering_prefill_write_between_the_pages_instead_of_dying(tmp_path):
    workdir = tmp_path / "bench"
    bench = [sys.executable, "-m", "pdxfer", "bench", "--workloads", "medium", "--medium-rooms", str(ROOMS), "--medium-in-flight", "4",
             "--systems", "pdxfer", "--repeat", "1", "--inline-kv-bytes", "0", "--topology", "1:2", "--page-order", "token_major",
             "--plan-indices", "2000", "--timeout", "120", "--json", "--workdir", str(workdir)]
    mount = f"mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm && exec \"$@\""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *bench],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)["workloads"]["medium"]["systems"]["pdxfer"]
    (run,) = result["runs"]
    assert result["mismatches"] == 0 and not result["errors"], result["errors"]
    assert run["ok"] == ROOMS  # every room succeeded, the prefill daemon alive to the end
    log = (workdir / "medium-pdxfer-1" / "prefill-daemon.log").read_text()
    assert "/dev/shm cannot back" in log and "No space left on device" in log  # it did find /dev/shm full, and fell back


def test_reserve_backs_a_range_of_sparse_shared_memory_and_says_why_it_could_not():
    memory = SharedMemory.create(8 << 20, "pdxfer-test-reserve", populate=False)
    path = os.path.join(SHM_DIR, memory.name)
    try:
        assert os.stat(path).st_blocks == 0  # sparse: no pages yet
        memory.reserve(2 << 20, 4 << 20)
        assert os.stat(path).st_blocks * 512 == 4 << 20  # exactly the range, before anything touched it
        os.unlink(path)  # say an operator removed the name: refused, not an OSError out of the daemon's handler
        with pytest.raises(InsufficientCapacity, match=r"^/dev/shm cannot back 1048576 more bytes of pdxfer-test-reserve-.*No such file"):
            memory.reserve(0, 1 << 20)
    finally:
        memory.owner = os.path.exists(path)
        memory.close()


def _faults() -> int:
    """This process's minor page faults so far."""
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])


@pytest.mark.parametrize("madvise", [True, False], ids=["populate-write", "before-linux-5.14"])
def test_populate_backs_and_maps_every_page_so_that_writing_them_takes_no_faults(madvise, monkeypatch):
    if not madvise:  # a kernel without MADV_POPULATE_WRITE: each page is read instead
        monkeypatch.setattr(host_memory, "_prefault", lambda address, length: False)
    memory = SharedMemory.create(8 << 20, "pdxfer-test-populate", populate=False)
    path = os.path.join(SHM_DIR, memory.name)
    try:
        pages = memory.array[:: mmap.PAGESIZE]
        before = _faults()
        pages[: pages.size // 2] = 1  # the first half, as a staged leg's engine thread would: a fault a page
        assert _faults() - before >= pages.size // 2
        assert memory.populate() == ""
        assert os.stat(path).st_blocks * 512 == 8 << 20  # every page backed
        before = _faults()
        pages[pages.size // 2 :] = 2  # the second half, now mapped: a few faults at most (the interpreter's own), not one a page
        assert _faults() - before < pages.size // 8
        seconds = memory.array[1 :: mmap.PAGESIZE]  # each page's second byte, which nothing wrote
        assert (pages[: pages.size // 2] == 1).all() and not seconds.any()  # populating wrote nothing
    finally:
        memory.close()


@pytest.mark.skipif(bool(_unavailable()), reason=_unavailable() or "-")
def test_populate_where_dev_shm_cannot_hold_it_keeps_nothing_and_says_why(tmp_path):
    script = (
        "import os\n"
        "from pdxfer.host.memory import SHM_DIR, SharedMemory\n"
        "memory = SharedMemory.create(8 << 20, 'pdxfer-test-populate', populate=False)\n"
        "with open(os.path.join(SHM_DIR, 'filler'), 'wb') as fh:\n"  # /dev/shm fills after the buffer was made
        "    os.posix_fallocate(fh.fileno(), 0, 12 << 20)\n"
        "print(memory.populate())\n"
        "print(os.stat(os.path.join(SHM_DIR, memory.name)).st_blocks)\n"
        "memory.close()\n"
    )
    mount = "mount -t tmpfs -o size=16m tmpfs /dev/shm && exec \"$@\""
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    why, blocks = proc.stdout.splitlines()
    assert why.startswith("/dev/shm cannot back 8388608 more bytes of pdxfer-test-populate-") and "No space left on device" in why
    assert blocks == "0"  # nothing of it kept: the daemon backs its staging buffer as legs reach it instead
