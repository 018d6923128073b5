"""Several "hosts" on one machine: Linux network namespaces joined by a bridge, with a Ray cluster
spanning them (a head in the first, workers in the others).

Layout: a hub namespace holds the bridge; each node namespace gets a veth pair whose one end
(``eth0``, address 10.<net>.0.<i + 1>/24) lives in the node and whose other end is a bridge port in
the hub. Only these addresses are used: the Ray head and workers are started with
``--node-ip-address`` inside their namespaces, and the engine driver runs in the head's namespace
(``NetnsCluster.run_in``), so gloo, the TCP store and Ray's own traffic all cross the veths.

Teardown kills exactly the processes inside the namespaces (``ip netns pids``), never ``ray stop``
(which would stop every Ray on the machine), then deletes the namespaces (and with them the veths
and the bridge). Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

RAY_PORT = 6379
#: Environment of every Ray process and driver here: a throwaway cluster on private addresses, so
#: no token authentication (Ray >= 2.5x enables it by default) and no usage reporting.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def netns_unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``, ``ip netns add`` refused), or
    None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"plprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"ip netns add failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NetnsCluster:
    """``num_nodes`` namespaces on one bridge and a Ray cluster over them.

    Args:
        num_nodes: namespaces (node 0 runs the Ray head with no CPUs, so actors go elsewhere).
        cpus_per_worker: Ray CPUs each worker node offers.
        ray_bin: the ``ray`` executable (the one next to this Python by default).

    Attributes:
        names: the node namespaces; addresses: their 10.x addresses; ray_address: "ip:port".
    """

    def __init__(self, num_nodes: int = 3, cpus_per_worker: int = 2, ray_bin: str | None = None):
        tag = f"pl{os.getpid() % 100000}"
        net = 100 + os.getpid() % 100  # 10.<net>.0.0/24: differs between concurrent runs
        self.hub = f"{tag}hub"
        self.names = [f"{tag}n{i}" for i in range(num_nodes)]
        self.addresses = [f"10.{net}.0.{i + 1}" for i in range(num_nodes)]
        self.ray_address = f"{self.addresses[0]}:{RAY_PORT}"
        self.ray_bin = ray_bin or str(Path(sys.executable).with_name("ray"))
        self.temp_dir = tempfile.mkdtemp(prefix="plray")
        self.cpus_per_worker = cpus_per_worker
        self._created: list[str] = []

    # ---- network -----------------------------------------------------------------------------
    def create_network(self) -> None:
        """The namespaces, the bridge in the hub, one veth pair per node, addresses, links up."""
        _ip("netns", "add", self.hub)
        self._created.append(self.hub)
        hub = ["-n", self.hub]
        _ip(*hub, "link", "add", "br0", "type", "bridge")
        _ip(*hub, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", ns)
            self._created.append(ns)
            port = f"p{i}"
            # Created in the node, its peer moved to the hub: no name lands in the root namespace.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            _ip("-n", ns, "link", "set", port, "netns", self.hub)
            _ip(*hub, "link", "set", port, "master", "br0")
            _ip(*hub, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def run_in(
        self, node: int, argv: list[str], env: dict[str, str] | None = None, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside node ``node``'s namespace (environment: ours plus ``env``)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.names[node], *argv],
            env={**os.environ, **RAY_ENV, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    # ---- Ray -----------------------------------------------------------------------------------
    def start_ray(self) -> None:
        """Head in node 0 (0 CPUs), a worker in every other node; waits until all have joined.

        Raises:
            RuntimeError: a ``ray start`` failed (its output in the message) or the nodes did
                not all join within 120 s.
        """
        common = ["--disable-usage-stats"]
        head = [
            self.ray_bin, "start", "--head", f"--node-ip-address={self.addresses[0]}",
            f"--port={RAY_PORT}", "--num-cpus=0", "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}", *common,
        ]  # fmt: skip
        self._ray_start(0, head)
        for i in range(1, len(self.names)):
            worker = [
                self.ray_bin, "start", f"--address={self.ray_address}",
                f"--node-ip-address={self.addresses[i]}", f"--num-cpus={self.cpus_per_worker}",
                *common,
            ]  # fmt: skip
            self._ray_start(i, worker)
        self._wait_nodes(len(self.names), 120.0)

    def _ray_start(self, node: int, argv: list[str], attempts: int = 3) -> None:
        # ``ray start`` waits a hard-coded 30 s for its raylet to register; on a loaded machine
        # that can pass, so a failed start is cleaned up (its namespace's processes) and retried.
        for attempt in range(attempts):
            res = self.run_in(node, argv, timeout=180)
            if res.returncode == 0:
                return
            self._kill_node_processes([node])
            if attempt == attempts - 1:
                raise RuntimeError(
                    f"ray start in {self.names[node]} failed {attempts} times:\n"
                    f"{res.stdout}{res.stderr}{self._log_tails()}"
                )

    def _log_tails(self) -> str:
        logs = Path(self.temp_dir, "session_latest", "logs")
        return "".join(
            f"\n--- {f.name}:\n" + f.read_text(errors="replace")[-1500:]
            for f in sorted(logs.glob("*.err"))
            if f.stat().st_size
        )

    def _wait_nodes(self, count: int, timeout_s: float) -> None:
        code = (
            "import ray; ray.init(address='auto', log_to_driver=False); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            res = self.run_in(0, [sys.executable, "-c", code], {"RAY_ADDRESS": self.ray_address})
            last = res.stdout.strip().splitlines()[-1:] and res.stdout.strip().splitlines()[-1]
            if res.returncode == 0 and last == str(count):
                return
            time.sleep(1.0)
        raise RuntimeError(f"only {last!r} of {count} Ray nodes joined")

    def node_pids(self, node: int) -> list[int]:
        """Processes inside node ``node``'s namespace."""
        res = subprocess.run(
            ["ip", "netns", "pids", self.names[node]], capture_output=True, text=True
        )
        return [int(p) for p in res.stdout.split()]

    def _kill_node_processes(self, nodes: Iterable[int]) -> None:
        """TERM, then KILL after 5 s, every process inside the namespaces of ``nodes``."""
        nodes = list(nodes)
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = [p for i in nodes for p in self.node_pids(i)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
                time.sleep(0.2)

    # ---- teardown ------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Kill every process inside the namespaces (TERM, then KILL after 5 s), delete the
        namespaces (their veths and the bridge go with them) and Ray's temp folder."""
        self._kill_node_processes(range(len(self.names)))
        for ns in reversed(self._created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
