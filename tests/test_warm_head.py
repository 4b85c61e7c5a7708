"""The local Ray head kept warm between commands (`cluster.keep_head_s`, cluster/warm_head.py), and the first
line `nestor train` prints before jax is imported (orchestrator/commands/first_line.py). The quickstart's
second command reusing the first one's head is tests/test_user_path.py's."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from nestor.cluster.head import head_processes
from nestor.cluster.warm_head import HeadSpec, command_env, stop_warm_heads, warm_heads
from nestor.orchestrator.commands.first_line import early_starting_line
from tests.settings import ROOT
from tests.helpers import child_env
from tests.test_cluster import user_shell

QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")

# A command's hold on the head: takes it, says its address (None: another command holds it), lets it go at a line
# on stdin.
HOLDER = """
import sys
from nestor.cluster.warm_head import HeadSpec, hold_head
lease = hold_head(HeadSpec(cpus=2, dashboard=False), keep_s=float(sys.argv[1]), on_phase=lambda t: print(t, flush=True))
print(lease.address if lease else None, flush=True)
sys.stdin.readline()
if lease:
    lease.release()
"""


class Holder:
    def __init__(self, env: dict[str, str], keep_s: float):
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER, str(keep_s)], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.said = []
        while (line := self.process.stdout.readline().strip()) and not (line == "None" or line.startswith("127.")):
            self.said.append(line)
        assert line, self.process.stderr.read()[-3000:]
        self.address = None if line == "None" else line

    def release(self) -> None:
        _, err = self.process.communicate("\n", timeout=60)
        assert self.process.returncode == 0, err[-3000:]


def gone(address: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while head_processes(address) or warm_heads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_kept_head_serves_one_command_at_a_time_and_ends_when_idle_or_stopped(tmp_path, monkeypatch):
    heads = tmp_path / "heads"
    monkeypatch.setenv("NESTOR_HEADS_DIR", str(heads))  # this test's heads only, in this process and its children
    env = user_shell(child_env(NESTOR_HEADS_DIR=str(heads)))
    try:
        first = Holder(env, keep_s=60)
        assert first.said == ["starting a local Ray head on 127.0.0.1"] and first.address
        assert {p.name() for p in head_processes(first.address)} >= {"gcs_server", "raylet"}
        # no daemon that only costs CPU: no log monitor without cluster.worker_logs, no idle worker started ahead
        commands = [p.cmdline() for p in head_processes(first.address)]  # a raylet names default_worker.py too
        assert not [c for c in commands if any(word.endswith(("log_monitor.py", "default_worker.py")) for word in c)
                    or c[0].startswith("ray::IDLE")], commands
        busy = Holder(env, keep_s=60)  # a second command meanwhile: a cluster of its own
        busy.release()
        assert busy.address is None
        assert stop_warm_heads() == ([], [first.address])  # held: left up
        first.release()

        again = Holder(env, keep_s=3)  # the last command's keep_s is the head's
        assert again.said == [f"using the local Ray head an earlier command kept up ({first.address})"], again.said
        assert again.address == first.address
        again.release()
        assert gone(first.address, timeout_s=45), "the head outlived its idle time"
        assert not list(heads.glob("*.json"))

        kept = Holder(env, keep_s=600)
        kept.release()
        assert kept.address and kept.address != first.address and warm_heads()
        nestor = str(Path(sys.executable).parent / "nestor")
        stopped = subprocess.run([nestor, "stop-head"], env=env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0 and stopped.stdout == f"stopped the local Ray head at {kept.address}\n", stopped
        assert gone(kept.address, timeout_s=30)
        again = subprocess.run([nestor, "stop-head"], env=env, capture_output=True, text=True, timeout=120)
        assert again.stdout == "no local Ray head of yours is up\n", again
    finally:
        stop_warm_heads(wait_s=10)


# A local head whose first GCS port is taken (held by a listening socket) before Ray binds it.
TAKEN_PORT = """
import os
import socket
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # 127.0.0.1, as the keeper and driver.launch set it
from nestor.cluster import warm_head
from nestor.cluster.rendezvous import free_port

taken = socket.create_server(("127.0.0.1", 0))
ports = [taken.getsockname()[1]]
warm_head.free_port = lambda host: ports.pop() if ports else free_port(host)
print(taken.getsockname()[1], warm_head.start_local_head(cpus=1, dashboard=False), flush=True)
"""


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_a_local_head_whose_port_was_taken_before_it_bound_starts_on_another():
    done = subprocess.run([sys.executable, "-c", TAKEN_PORT], env=child_env(), capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    taken, address = done.stdout.split()
    assert address.startswith("127.0.0.1:") and address != f"127.0.0.1:{taken}"


def test_free_ports_are_drawn_above_rays_worker_ports_and_below_the_ephemeral_and_node_ports(monkeypatch):
    from nestor.cluster import rendezvous

    monkeypatch.setattr(rendezvous, "_ephemeral_ports_start", lambda: 32_768)  # Linux's default
    ports = {rendezvous.free_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1 and all(20_000 <= port < 30_000 for port in ports), ports
    monkeypatch.setattr(rendezvous, "_ephemeral_ports_start", lambda: 25_000)
    assert all(20_000 <= rendezvous.free_port("127.0.0.1") < 25_000 for _ in range(20))
    monkeypatch.setattr(rendezvous, "_ephemeral_ports_start", lambda: 20_500)  # no room: the kernel's choice
    assert not 20_000 <= rendezvous.free_port("127.0.0.1") < 20_500


def test_a_heads_key_is_its_python_cpus_dashboard_and_ray_settings_not_the_shells_other_variables(monkeypatch):
    key = HeadSpec(cpus=3, dashboard=True).key()
    for name, value in (("PWD", "/somewhere/else"), ("XLA_FLAGS", "--xla_dump_to=/tmp/elsewhere"),
                        ("TMUX_PANE", "%3"), ("RAY_AUTH_MODE", "token")):
        monkeypatch.setenv(name, value)  # the workers get the command's own (command_env)
    assert HeadSpec(cpus=3, dashboard=True).key() == key
    assert HeadSpec(cpus=2, dashboard=True).key() != key
    assert HeadSpec(cpus=3, dashboard=False).key() != key
    assert HeadSpec(cpus=3, dashboard=True, worker_logs=True).key() != key  # a head without its log monitor
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # read by the head's own daemons
    assert HeadSpec(cpus=3, dashboard=True).key() != key
    assert "XLA_FLAGS" in command_env() and not [name for name in command_env() if name.startswith("RAY_")]


def test_the_first_line_is_read_from_the_cluster_keys_as_plain_yaml(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    local = "a local Ray cluster on 127.0.0.1"
    assert early_starting_line(QUICKSTART, []) == f"starting 2 worker process(es) x 4 cpu device(s) on {local}"
    layer = tmp_path / "hosts.yaml"
    layer.write_text("cluster:\n  hosts: 4\n  devices_per_host: 2\n")
    assert early_starting_line(QUICKSTART, [str(layer)]) == f"starting 4 worker process(es) x 2 cpu device(s) on {local}"
    assert early_starting_line(QUICKSTART, [str(layer), "cluster.hosts=1", "cluster.address=10.0.0.5:6379"]) == \
        "starting 1 worker process(es) x 2 cpu device(s) on the Ray cluster at 10.0.0.5:6379"
    # not the Ray launcher, or keys only the config's checks can judge: the line waits for them
    for overrides in (["cluster.launcher=inprocess"], ["cluster.hosts=two"], ["cluster={hosts: 2}"],
                      ["cluster.accelerator=npu"], [str(tmp_path / "missing.yaml")]):
        assert early_starting_line(QUICKSTART, overrides) is None, overrides
    assert early_starting_line(str(tmp_path / "missing.yaml"), []) is None
