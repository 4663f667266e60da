"""The README's SGLang and vLLM sections, run as they stand (issue 47): each is a script
(examples/sglang-pd.sh, examples/vllm-pd.sh) that the README shows in full and `make
demo-sglang-http` / `make demo-vllm-http` run. Each starts two pdxfer daemons, two real HTTP
servers (`python -m sglang.launch_server`; vLLM's OpenAI server) and a router (SGLang's
router; `pdxfer proxy`), makes the model directory with the command it names, and sends one
request. The test runs the file in the engine environment, with free ports in place of its
fixed ones and a runtime directory of its own, and checks the answer against a plain
engine's tokens for the same prompt (the first of the standard waves, whose reference the
other engine tests share) and that the room succeeded on the decode daemon."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest

from tests.engines.conftest import ENGINE_TEST_TIMEOUT
from tests.engines.procs import REPO_ROOT
from tests.listen_ports import free_port

pytestmark = pytest.mark.timeout(ENGINE_TEST_TIMEOUT)

SCRIPT_TIMEOUT = 900  # two servers start in 10-60 s each on an idle 2-core machine; minutes on a busy one
ROOM_SUCCEEDED = 'pdxfer_room_transitions_total{state="success"} 1.0'


def readme_block(containing: str) -> str:
    with open(os.path.join(REPO_ROOT, "README.md")) as fh:
        blocks = re.findall(r"```sh\n(.*?)```", fh.read(), re.S)
    found = [block for block in blocks if containing in block]
    assert len(found) == 1, f"{len(found)} sh blocks in the README contain {containing!r}"
    return found[0]


def run_script(name: str, ports: tuple[int, ...], model_dir: str, workdir: str) -> tuple[str, str]:
    """Run examples/NAME as the README shows it, each of ``ports`` (all of which it must
    name) replaced by a free port; (its stdout, its log). Whatever it leaves running is
    killed with its process group."""
    path = os.path.join(REPO_ROOT, "examples", name)
    with open(path) as fh:
        script = fh.read()
    assert readme_block(f"\n{script.splitlines()[1]}\n") == script, f"the README shows examples/{name} as it is"
    for port in ports:
        assert re.search(rf"\b{port}\b", script), (name, port)
        script = re.sub(rf"\b{port}\b", str(free_port()), script)
    runnable = os.path.join(workdir, name)
    with open(runnable, "w") as fh:
        fh.write(script)
    runtime_dir = tempfile.mkdtemp(prefix="pdx-")  # short: socket paths
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]), "MODEL": model_dir,
           "PDXFER_RUNTIME_DIR": runtime_dir}
    log_path = os.path.join(workdir, f"{name}.log")
    with open(log_path, "w") as log:
        shell = subprocess.Popen(["bash", runnable], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                 start_new_session=True)
        try:
            out, _ = shell.communicate(timeout=SCRIPT_TIMEOUT)
        finally:
            try:
                os.killpg(shell.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            shell.wait()
    with open(log_path) as fh:
        log_text = fh.read()
    assert shell.returncode == 0, f"examples/{name} exited {shell.returncode}\n{out[-6000:]}\n--- its log (tail) ---\n{log_text[-6000:]}"
    return out, log_text


def answer_and_metric(out: str, key: str) -> tuple[dict, list[str]]:
    """The router's answer (the JSON object with ``key``; the daemons' ready lines and the
    servers' logs share stdout) and the metric lines the script printed."""
    lines = out.strip().splitlines()
    objects = []
    for line in lines:
        try:
            objects.append(json.loads(line))
        except ValueError:
            continue
    answers = [o for o in objects if isinstance(o, dict) and key in o]
    assert len(answers) == 1, out[-6000:]
    return answers[0], [line for line in lines if line.startswith("pdxfer_")]


def test_the_readme_sglang_lines_answer_a_plain_engines_tokens(needs_sglang, model_dir, waves, sglang_reference, tmp_path):
    out, log = run_script("sglang-pd.sh", (18998, 9100, 9101, 30000, 30001, 8998, 8000), model_dir, str(tmp_path))
    answer, metrics = answer_and_metric(out, "output_ids")
    first = waves[0][0]
    with open(os.path.join(REPO_ROOT, "examples", "sglang-pd.sh")) as fh:
        assert f'"input_ids": {list(first.input_ids)}' in fh.read()  # the prompt whose reference the other tests share
    assert answer["output_ids"] == sglang_reference[0][0], (answer, sglang_reference[0][0])
    assert len(answer["output_ids"]) == first.max_new_tokens
    assert metrics == [ROOM_SUCCEEDED], out
    assert "disaggregation_transfer_backend': 'pdxfer'" in out + log  # the servers' arguments, as SGLang logs them


def test_the_readme_vllm_lines_answer_a_plain_engines_tokens(needs_vllm, model_dir, waves, vllm_reference, tmp_path):
    out, _ = run_script("vllm-pd.sh", (18998, 9100, 9101, 8100, 8200, 8000), model_dir, str(tmp_path))
    answer, metrics = answer_and_metric(out, "choices")
    first = waves[0][0]
    assert answer["choices"][0]["prompt_token_ids"] == list(first.input_ids), answer
    assert answer["choices"][0]["token_ids"] == vllm_reference[0][0]["output_ids"], (answer, vllm_reference[0][0])
    assert metrics == [ROOM_SUCCEEDED], out
