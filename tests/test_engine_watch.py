"""host/processes.EngineWatch: how a daemon learns that an engine process it serves has
exited (A10), through a pidfd the event loop waits on, or by its start time where the
kernel gives no pidfd; a process in another pid namespace is not watched."""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from pdxfer.host import processes
from pdxfer.host.processes import EngineWatch, pid_namespace


@pytest.fixture
def engine():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_watched_engine_has_a_pidfd_that_becomes_readable_when_it_exits(engine):
    watch = EngineWatch()
    assert watch.add(b"conn", engine.pid, pid_namespace())
    fd = watch.pidfd(b"conn")
    assert fd is not None and select.select([fd], [], [], 0)[0] == []  # alive: nothing to read
    engine.kill()
    assert select.select([fd], [], [], 10)[0] == [fd]
    assert watch.gone() == []  # the loop hears it from the fd, not from the tick
    assert watch.forget(b"conn") == engine.pid and watch.pidfd(b"conn") is None
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_without_pidfds_an_exited_engine_is_told_once_by_its_start_time(engine, monkeypatch):
    monkeypatch.setattr(processes, "_pidfd", lambda pid: None)  # a kernel before 5.3
    watch = EngineWatch()
    assert watch.add(b"conn", engine.pid, pid_namespace()) and watch.pidfd(b"conn") is None
    assert watch.gone() == []
    engine.kill()
    engine.wait()
    assert watch.gone() == [(b"conn", engine.pid)]
    assert watch.gone() == []


def test_a_pid_reused_before_its_pidfd_opened_is_watched_by_start_time(engine, monkeypatch):
    watch = EngineWatch()
    times = iter([111, 222])  # the process seen at hello, then another one under the same pid
    monkeypatch.setattr(processes, "start_time", lambda pid: next(times, 222))
    assert watch.add(b"conn", engine.pid, pid_namespace())
    assert watch.pidfd(b"conn") is None and watch.gone() == [(b"conn", engine.pid)]


def test_an_engine_in_another_pid_namespace_or_gone_already_is_not_watched(engine):
    watch = EngineWatch()
    assert not watch.add(b"a", engine.pid, pid_namespace() + 1)
    assert not watch.add(b"b", engine.pid, 0)
    engine.kill()
    engine.wait()
    assert not watch.add(b"c", engine.pid, pid_namespace())
    assert watch.pidfds == {} and watch.started == {}
