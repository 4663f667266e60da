"""What a new user hits in a first hour with `pdxfer serve` (issue 31): a daemon must
refuse, in one line that names the fix, what would otherwise take over another
daemon's sockets, hang, claim a protocol it does not use, change a shared
directory's mode, or end in a traceback after the transfer engines started; a cluster
secret set on one side only must fail rooms at once, saying so; and the README's engine
example must be a file that runs as the README shows it."""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from pdxfer.core.protocol import AdminPeers, ErrorCode, RoomState
from pdxfer.ops.inspection import AdminClient
from pdxfer.core.stamp import HEADER_BYTES
from pdxfer.tools.launch import start_daemon

from .conftest import needs_mooncake
from .roomkit import engine, free_port, kill, start_room, wait_until

pytestmark = needs_mooncake


def serve(role: str, runtime_dir: str, *flags: str, env: dict | None = None, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run `pdxfer serve` that is expected to refuse: it must exit by itself (one that
    starts, or hangs, runs into the timeout and fails the test)."""
    argv = [*prefix, sys.executable, "-m", "pdxfer", "serve", "--role", role, "--runtime-dir", runtime_dir, *flags]
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=run_env)


def refusal(out: subprocess.CompletedProcess) -> str:
    """The one line a refused start prints: no ready line, no traceback, and nothing
    from a transfer engine (whose log lines would say it had started)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and not out.stdout.strip(), (out.returncode, out.stdout, out.stderr)
    assert len(lines) == 1 and "cannot start: " in lines[0], out.stderr
    return lines[0]


def inode(path: str) -> int:
    return os.stat(path).st_ino


def test_a_second_daemon_with_a_live_daemons_name_refuses_and_leaves_its_sockets(daemons, runtime_dir):
    first = daemons("prefill")
    sockets = [first.ready["engine"][len("ipc://") :], first.ready["admin"][len("ipc://") :]]
    before = [inode(p) for p in sockets]
    line = refusal(serve("prefill", runtime_dir, "--bootstrap-port", "0"))
    assert f"pid {first.proc.pid}" in line and "--name" in line, line
    assert [inode(p) for p in sockets] == before  # neither unlinked nor replaced
    # Another name given the live daemon's socket (or a daemon from before name locks): refused too.
    line = refusal(serve("prefill", runtime_dir, "--name", "other", "--bootstrap-port", "0", "--engine-endpoint", first.ready["engine"]))
    assert f"{sockets[0]} (--engine-endpoint) is in use by a live process" in line, line
    assert [inode(p) for p in sockets] == before
    # The first daemon still answers its operators on its admin socket.
    rooms = subprocess.run([sys.executable, "-m", "pdxfer", "rooms", "--name", "prefill", "--runtime-dir", runtime_dir],
                           capture_output=True, text=True, timeout=60)
    assert rooms.returncode == 0, rooms.stderr


def test_a_killed_daemons_name_and_stale_sockets_are_taken_over(runtime_dir):
    first = start_daemon("decode", runtime_dir, stderr=subprocess.DEVNULL)
    first.proc.send_signal(signal.SIGKILL)
    first.wait()
    assert os.path.exists(first.ready["engine"][len("ipc://") :])  # left behind by the kill
    second = start_daemon("decode", runtime_dir, stderr=subprocess.DEVNULL)
    try:
        assert second.ready["engine"] == first.ready["engine"]
    finally:
        assert second.stop() == 0


def test_a_runtime_dir_whose_socket_paths_do_not_fit_is_refused_at_start():
    line = refusal(serve("decode", "/tmp/pdx-" + "x" * 100))
    assert "107" in line and "--runtime-dir" in line, line


@pytest.mark.skipif(bool(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else False,
                    reason="this host has RDMA devices")
def test_rdma_on_a_host_without_rdma_devices_is_refused(runtime_dir):
    line = refusal(serve("decode", runtime_dir, "--protocol", "rdma"))
    assert "/sys/class/infiniband" in line and "--protocol tcp" in line, line


def test_an_existing_runtime_dir_others_can_enter_is_refused_and_left_as_it_was(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    line = refusal(serve("decode", str(shared)))
    assert "0755" in line and "--runtime-dir" in line, line
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755


def test_a_missing_runtime_dir_is_created_owner_only(tmp_path):
    short = f"/tmp/pdx-new-{os.getpid()}"
    try:
        daemon = start_daemon("decode", short, stderr=subprocess.DEVNULL)
        assert stat.S_IMODE(os.stat(short).st_mode) == 0o700
        assert daemon.stop() == 0
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("role,flag", [("prefill", "--bootstrap-port"), ("decode", "--http-port")])
def test_a_busy_port_is_refused_before_the_transfer_engine_starts_naming_its_holder(runtime_dir, role, flag):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        line = refusal(serve(role, runtime_dir, flag, str(holder.getsockname()[1]), env={"GLOG_minloglevel": "0"}))
    assert flag in line and f"pid {os.getpid()}" in line, line


def test_an_unusable_runtime_dir_is_refused_before_the_transfer_engine_starts(tmp_path):
    (tmp_path / "file").write_text("")
    line = refusal(serve("decode", str(tmp_path / "file" / "rt"), env={"GLOG_minloglevel": "0"}))
    assert "is not a directory" in line and "--runtime-dir" in line, line


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
def test_an_unresolvable_host_is_refused_before_the_transfer_engine_starts(runtime_dir):
    # In a network namespace of its own, so that resolving the name sends nothing off this host.
    line = refusal(serve("decode", runtime_dir, "--host", "nope.invalid", prefix=("unshare", "--net"), env={"GLOG_minloglevel": "0"}))
    assert "--host nope.invalid does not resolve" in line, line


def test_a_daemon_without_a_transfer_engine_says_which_wheel_to_install(tmp_path, runtime_dir):
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class HideMooncake:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mooncake':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, HideMooncake())\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = serve("decode", runtime_dir, env=env)
    # The CUDA build imports only where a driver and libcudart are (as the Makefile judges it).
    wheel = "mooncake-transfer-engine" if cuda_host() else "mooncake-transfer-engine-non-cuda"
    assert f"pip install {wheel} (" in out.stderr, out.stderr
    refusal(out)


def cuda_host() -> bool:
    return bool(shutil.which("nvidia-smi") and ctypes.util.find_library("cudart"))


@pytest.mark.skipif(cuda_host(), reason="this host has CUDA: the CUDA build of the transfer engine is the one it needs")
def test_the_cuda_build_of_the_transfer_engine_on_a_host_without_cuda_is_refused_naming_the_cpu_build(tmp_path, runtime_dir):
    """`pip install -e '.[mooncake]'` on a CPU host: the daemon used to start and its
    transfer engine's process to die at import with a 19-line traceback. The CUDA
    wheel's metadata on the path stands in for it (installed_engine looks for it first)."""
    dist = tmp_path / "mooncake_transfer_engine-0.3.13.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine\nVersion: 0.3.13\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    line = refusal(serve("decode", runtime_dir, env=env))
    assert "the CUDA build (mooncake-transfer-engine 0.3.13)" in line, line
    assert "fix: pip uninstall -y mooncake-transfer-engine && pip install mooncake-transfer-engine-non-cuda" in line, line


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_host_of_every_address_is_refused_since_peers_are_told_it(runtime_dir, host):
    """--host 0.0.0.0 used to start and advertise 0.0.0.0:PORT to peers and routers as
    its bootstrap and transfer-engine address, which reaches nobody."""
    line = refusal(serve("prefill", runtime_dir, "--host", host, "--bootstrap-port", "0"))
    assert f"--host {host} is every address of this machine" in line and "status.podIP" in line, line


def test_admin_writes_on_a_tcp_admin_endpoint_without_a_cluster_secret_is_refused(tmp_path, runtime_dir):
    """Anyone who reaches a TCP admin port could fail rooms and drain peers: refused,
    naming the ways out; with the secret (or read-only, or on the ipc socket) it starts."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    line = refusal(serve("decode", runtime_dir, "--admin-endpoint", endpoint, "--admin-writes"))
    assert f"--admin-writes on --admin-endpoint {endpoint} without --cluster-secret-file" in line, line
    assert "fix: give --cluster-secret-file" in line and "--secret-file" in line, line
    (tmp_path / "secret").write_text("s" * 32 + "\n")
    daemon = start_daemon("decode", runtime_dir, "--admin-endpoint", endpoint, "--admin-writes",
                          "--cluster-secret-file", str(tmp_path / "secret"), stderr=subprocess.DEVNULL)
    assert daemon.stop() == 0


def test_a_runtime_dir_on_a_filesystem_that_refuses_it_is_one_line():
    """/sys passes the permission bits as root and refuses the mkdir itself: that used
    to end in a PermissionError traceback."""
    line = refusal(serve("decode", "/sys/pdxfer", env={"GLOG_minloglevel": "0"}))
    assert "/sys/pdxfer" in line and "--runtime-dir" in line, line  # as another user than root: not writable by it


@pytest.mark.parametrize("secrets,reason,logged", [
    (("a", ""), "the prefill has a cluster secret (--cluster-secret-file), the decode has none",
     "gave no proof: the prefill has a cluster secret (--cluster-secret-file), the decode has none"),
    (("", "a"), "the prefill has no cluster secret (--cluster-secret-file), the decode has one",
     "answered with a proof of a cluster secret (--cluster-secret-file), and the prefill has none"),
    (("a", "b"), "the two have different cluster secrets (--cluster-secret-file)",
     "gave no proof of the prefill's cluster secret (--cluster-secret-file): it has another one"),
], ids=["prefill-only", "decode-only", "different"])
def test_a_cluster_secret_on_one_side_only_fails_the_room_at_once_naming_it(daemons, tmp_path, secrets, reason, logged):
    """Either way round (or with two secrets), the decode's room fails within a moment,
    not at the 30 s bootstrap timeout, saying which side lacks the secret, and the
    prefill's log names the decode daemon it refused and why. It names it by its
    incarnation, all the handshake tells: its name and session come in peer_hello,
    which a decode daemon sends only to a prefill that proved the secret."""
    flags = []
    for side, letter in zip(("prefill", "decode"), secrets):
        (tmp_path / side).write_text(letter * 20 + "\n")
        flags.append(("--cluster-secret-file", str(tmp_path / side)) if letter else ())
    prefill, decode = daemons("prefill", *flags[0]), daemons("decode", *flags[1])
    p, d = engine(prefill), engine(decode)
    try:
        asked = time.monotonic()
        d.expect(5, prefill.bootstrap, [1, 2], d.alloc_slot())
        status = d.wait(5, timeout=10)
        took = time.monotonic() - asked
    finally:
        p.close()
        d.close()
    assert status.state is RoomState.FAILED and status.code is ErrorCode.UNAUTHENTICATED and status.fenced, status
    assert reason in status.reason and took < 5, (status.reason, took)
    refused = wait_until(lambda: [line for line in open(prefill.log_path) if "closing a connection from" in line and decode.ready["incarnation"] in line],
                         10, "the prefill to log the refusal")
    assert logged in refused[0], refused


def log_lines(daemon, *needles: str) -> list[str]:
    with open(daemon.log_path) as fh:
        return [line for line in fh if all(n in line for n in needles)]


def test_a_prefill_killed_with_sigkill_is_shown_gone_and_logged_at_once(daemons):
    """The decode's `peers` stops calling it alive within a moment of the kill (its
    connection closed), and its log says so, without waiting for heartbeats."""
    prefill, decode = daemons("prefill"), daemons("decode")
    p, d = engine(prefill), engine(decode)
    try:
        start_room(p, d, prefill.bootstrap, 1, [1, 2], [3, 4], seed=1)
        assert d.wait(1, timeout=10).state is RoomState.SUCCESS
        assert [peer.state for peer in admin_peers(decode)] == ["alive"]
        killed = kill(prefill)
        gone = wait_until(lambda: [peer.state for peer in admin_peers(decode) if peer.state != "alive"], 3, "the prefill shown not alive")
        seen = time.monotonic() - killed
        lost = wait_until(lambda: log_lines(decode, "WARNING", prefill.bootstrap, "connection"), 3, "the decode to log the lost prefill")
    finally:
        p.close()
        d.close()
    assert gone == ["connecting"] and seen < 3, (gone, seen)
    assert "lost" in lost[0] or "refused" in lost[0], lost


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm-to-group"])
def test_ctrl_c_or_a_sigterm_to_the_process_group_stops_a_daemon_quietly(runtime_dir, tmp_path, sig):
    """A shell's Ctrl-C (SIGINT) or a SIGTERM to the whole group reaches the daemon and
    its transfer engine's process alike: the daemon drains and stops, exit 0, and its
    log holds no traceback and no error of an engine process ended under it."""
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = start_daemon("prefill", runtime_dir, "--log-level", "info", stderr=log, own_group=True)
    assert daemon.ready["engine_pid"] != daemon.pid  # its transfer engine runs in a process of its own
    os.killpg(daemon.pid, sig)
    code = daemon.wait(20)
    text = log_path.read_text()
    assert code == 0, text
    assert "stopped" in text and "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert not [line for line in text.splitlines() if " ERROR " in line], text


def admin_peers(daemon) -> list:
    with AdminClient(daemon.ready["admin"]) as admin:
        return list(admin.call(AdminPeers).peers)


# --- the README's engine example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(language: str, containing: str) -> str:
    with open(os.path.join(ROOT, "README.md")) as fh:
        blocks = re.findall(rf"```{language}\n(.*?)```", fh.read(), re.S)
    found = [block for block in blocks if containing in block]
    assert len(found) == 1, f"{len(found)} {language} blocks in the README contain {containing!r}"
    return found[0]


def test_the_readme_links_the_engine_example_and_pastes_none_of_it():
    """The README links the file a reader runs, rather than a copy that can drift."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        readme = fh.read()
    assert "[`examples/engine.py`](examples/engine.py)" in readme
    assert "from pdxfer import Client" not in readme and "def rank_heads" not in readme


def load_example():
    spec = importlib.util.spec_from_file_location("engine_example", os.path.join(ROOT, "examples", "engine.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_the_engine_example_states_its_model_and_shared_memory_as_it_maps_them():
    example = load_example()
    doc = " ".join(example.__doc__.split())
    for tp in (1, 2, 8):
        with example.kv_cache(len(example.rank_heads(0, tp))) as memory:
            assert sum(m.size for m in memory.values()) == 32 * 2**20 // tp
    assert "= 32 MiB / TP" in doc and f"{example.LAYERS} layers of {example.HEADS} KV heads of {example.HEAD_DIM} float32" in doc
    assert (f"{example.LAYERS} layers x K and V x {example.NUM_PAGES} pages x {example.PAGE_SIZE} tokens x {example.HEADS}/TP heads "
            f"x {example.HEAD_DIM * 4} bytes") in doc
    assert f"the prompt's {example.NUM_TOKENS} tokens" in doc and f"ceil(({example.NUM_TOKENS} + {example.DRAFT_TOKENS}) / {example.PAGE_SIZE})" in doc
    assert f"(0 to {example.NUM_PAGES - 1})" in doc and f"token t of page p at row p * {example.PAGE_SIZE} + t" in doc
    aux = example.AUX_SLOTS * (HEADER_BYTES + example.AUX_PAYLOAD_BYTES)
    assert f"(a {HEADER_BYTES}-byte stamp" in doc and f"= {aux / 2**20:.1f} MiB" in doc, aux


def test_the_engine_example_ranks_hold_every_head_once():
    """Its ranks split the model's heads as the docstring says: every head held by
    exactly one rank, in order, whatever the TP size that divides them."""
    example = load_example()
    for tp in (1, 2, 4, 8):
        held = [h for rank in range(tp) for h in example.rank_heads(rank, tp)]
        assert held == list(range(example.HEADS)), (tp, held)


def test_the_readme_engine_example_runs_as_written(runtime_dir):
    """The README's lines as they stand, but for a free port (18998 may be another
    user's) and the activation of .venv: this suite's interpreter goes first on PATH
    instead, with this checkout's pdxfer on PYTHONPATH whatever that environment has
    installed. They name no socket and no runtime directory: daemons and engines find
    each other in the default one, here this test's (PDXFER_RUNTIME_DIR)."""
    script = readme_block("sh", "python examples/engine.py")
    assert script.startswith(". .venv/bin/activate\n") and "18998" in script, script
    assert "engine.sock" not in script and "--runtime-dir" not in script and "/tmp/" not in script, script
    script = script.removeprefix(". .venv/bin/activate\n").replace("18998", str(free_port()))
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]), "PYTHONPATH": ROOT,
           "PDXFER_RUNTIME_DIR": runtime_dir}
    shell = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             start_new_session=True)
    try:
        out, _ = shell.communicate(timeout=120)
    finally:  # the daemons too, should the script not have stopped them
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    lines = out.splitlines()
    said = {line.split(":")[0]: line.split(": ", 1)[1] for line in lines if line.split(" rank ")[0] in ("prefill", "decode")}
    assert said.keys() == {"prefill rank 0 of 2, room 7", "prefill rank 1 of 2, room 7", "decode rank 0 of 1, room 7"}, out
    assert all(outcome.startswith("success") for outcome in said.values()), out
    assert "heads 0-7 of every layer and the aux record as the prefill wrote them" in said["decode rank 0 of 1, room 7"], out
    assert not any(line.startswith("Traceback") for line in lines), out
    for role in ("prefill", "decode"):  # the script's last line stopped both daemons
        assert any(line.endswith(f"pdxfer {role} daemon {role} stopped") for line in lines), out


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 2), (4, 2)], ids=["fan-out", "fan-in"])
def test_the_engine_example_moves_a_room_between_the_tp_sizes_its_flags_choose(daemons, runtime_dir, prefill_tp, decode_tp):
    """As its docstring says, other TP sizes work too: every decode rank checks its heads
    against what the prefill ranks wrote."""
    # One request for every decode rank's legs whatever the ranks' timing (A5), as tests/test_ranks.py runs them.
    prefill, _ = daemons("prefill"), daemons("decode", "--expect-batch-ms", "10000")
    script = os.path.join(ROOT, "examples", "engine.py")
    env = {**os.environ, "PYTHONPATH": ROOT, "PDXFER_RUNTIME_DIR": runtime_dir}
    decode = subprocess.Popen([sys.executable, script, "decode", "11", prefill.bootstrap, "--tp", str(decode_tp), "--prefill-tp", str(prefill_tp)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        sent = subprocess.run([sys.executable, script, "prefill", "11", "--tp", str(prefill_tp)], capture_output=True, text=True, env=env, timeout=120)
        received, _ = decode.communicate(timeout=120)
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()
    assert sent.returncode == 0 and decode.returncode == 0, (sent.stdout, sent.stderr, received)
    assert sorted(sent.stdout.splitlines()) == [f"prefill rank {r} of {prefill_tp}, room 11: success" for r in range(prefill_tp)], sent.stdout
    heads = 8 // decode_tp
    assert sorted(line for line in received.splitlines() if line.startswith("decode rank")) == [
        f"decode rank {r} of {decode_tp}, room 11: success; heads {r * heads}-{(r + 1) * heads - 1} of every layer and the aux record as the prefill wrote them"
        for r in range(decode_tp)], received
