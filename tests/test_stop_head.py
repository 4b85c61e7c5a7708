"""`nestor stop-head --address HOST:PORT` stops a head's processes that name its port on any of this
machine's addresses (a head started without --node-ip-address names the host's own IP), and no others."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import psutil
import pytest

from nestor.cluster.head import local_hosts
from nestor.cluster.rendezvous import free_port
from tests.settings import ROOT
from tests.helpers import child_env

SLEEPER = "import time; time.sleep(120)"


def own_ip() -> str | None:
    """Returns an IPv4 address of this machine other than loopback, or None."""
    return next((entry.address for addresses in psutil.net_if_addrs().values() for entry in addresses
                 if entry.family == socket.AF_INET and not entry.address.startswith("127.")), None)


def test_stop_head_by_loopback_ends_the_daemons_that_name_the_hosts_own_ip_and_no_others():
    ip = own_ip()
    if ip is None:
        pytest.skip("this machine has no address but loopback")
    assert {ip, "127.0.0.1", "localhost", socket.gethostname()} <= local_hosts()
    port = free_port("127.0.0.1")
    ours = [f"{ip}:{port}", f"{ip}:{port}", f"localhost:{port}"]  # the raylet, the dashboard, a worker...
    theirs = [f"{ip}:{port}0", f"192.0.2.250:{port}"]  # a port that starts like ours; a head of another machine
    started = {address: subprocess.Popen([sys.executable, "-c", SLEEPER, f"--gcs-address={address}"])
               for address in ours[1:] + theirs}
    started[ours[0] + " (gcs_address)"] = subprocess.Popen([sys.executable, "-c", SLEEPER, f"--gcs_address={ours[0]}"])
    try:
        time.sleep(0.5)
        began = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "nestor.orchestrator.commands.cli", "stop-head", "--address",
                                 f"127.0.0.1:{port}"], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == f"stopped the Ray head at 127.0.0.1:{port}: 3 " \
                                                                    "processes", result.stdout + result.stderr
        for address, process in started.items():
            if address.split(" ")[0] in theirs:
                assert process.poll() is None, address
            else:
                assert process.wait(timeout=10) is not None, address
        # ended by SIGTERM, and unreaped (this process is their parent): no wait for the 10 s grace, twice
        assert time.monotonic() - began < 15, time.monotonic() - began
    finally:
        for process in started.values():
            process.kill()
