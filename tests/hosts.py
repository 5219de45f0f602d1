"""Real hosts on this machine, for the cluster tests and benchmarks that cross hosts.

    with Hosts(3) as hosts:                      # host 0 is the head
        head, a, b = hosts
        hosts.start_ray(slots={1: 2, 2: 2})      # `ray start` inside each host
        a.limit_rate(gbit=1.0)                   # tc tbf on both ends of a's link
        a.partition(); a.heal()                  # the link down, then up again
        b.kill()                                 # every process of b, by pid
        head.run([...ringray train --address ...])   # a command inside a host

Each host is a Linux network namespace with its own UTS namespace (a host name nobody
resolves: ``rr-h0``, ``rr-h1``, ...) and mount namespace, joined to the others by a veth pair
on a bridge. The bridge lives in a namespace of its own (the "switch"), so nothing is added to
the machine's own namespace: the hosts' addresses (198.18.0.0/15, the range reserved for
network benchmarks) exist only inside namespaces made here. A host's namespaces are held by
one anchor process (``unshare ... sleep``); every command run "on" a host enters them with
``nsenter``, and Ray's processes inherit them. A host's processes are the ones whose network
namespace is the host's, found in /proc: a kill stops exactly those, by pid.

Options per host: ``second_interface`` (a second veth on a second bridge, 198.19.0.0/24,
shared only by the hosts that have one: a network that does not reach the others) and
``local_dir`` (a tmpfs mounted at that path inside the host's mount namespace: a node-local
directory the others cannot see). Everything is removed on exit, also when a test fails:
the host's processes, the anchors (the namespaces, their links and the bridges go with
them).

Needs root (``unshare --net``); :func:`hosts_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

FIRST_NET = "198.18.0"
"""Every host's first interface: 198.18.0.(index + 1)/24."""
SECOND_NET = "198.19.0"
"""The optional second interface: 198.19.0.(index + 1)/24, on a bridge of its own."""
RAY_PORT = 6379
RAY_START_COMMON = ("--disable-usage-stats", "--block")
HEALTH_CHECKS = json.dumps({"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                            "health_check_timeout_ms": 1000})
"""A node silent for about 3 s is declared dead (a partitioned one too: each check times out
after 1 s instead of Ray's 10 s)."""
VENV_BIN = Path(sys.executable).parent


def hosts_unavailable() -> str | None:
    """Why hosts cannot be made here (for ``pytest.skip``), or None."""
    if os.geteuid() != 0:
        return "real hosts need root (network and UTS namespaces)"
    for tool in ("unshare", "nsenter", "ip", "tc"):
        if shutil.which(tool) is None:
            return f"real hosts need {tool!r}, which is not installed"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"cannot make namespaces here: {probe.stderr.strip()}"
    return None


def _net_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


OWNER_VARIABLE = "RINGRAY_HOSTS_OWNER"
"""Set to the harness's pid in every process it starts on a host (Ray's inherit it), so
that a later harness can find and stop what a harness killed without cleaning up left."""


def sweep_orphans() -> list[int]:
    """Kill the processes of earlier harnesses whose own process is gone (a crash or a
    SIGKILL skipped their cleanup); returns their pids. Only processes that carry
    :data:`OWNER_VARIABLE` are considered."""
    killed = []
    marker = f"{OWNER_VARIABLE}=".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        for item in environ.split(b"\0"):
            if item.startswith(marker):
                owner = int(item[len(marker):] or 0)
                if owner and not Path(f"/proc/{owner}").exists():
                    _kill(int(entry))
                    killed.append(int(entry))
                break
    return killed


class _Anchor:
    """A process that holds new namespaces (and does nothing else)."""

    def __init__(self, hostname: str) -> None:
        self.process = subprocess.Popen(
            ["unshare", "--net", "--uts", "--mount", "--propagation", "private", "sh", "-c",
             f"hostname {hostname} && ip link set lo up && exec sleep infinity"],
            stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, OWNER_VARIABLE: str(os.getpid())})
        self.pid = self.process.pid
        deadline = time.monotonic() + 10
        while _net_namespace(self.pid) == _net_namespace(os.getpid()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"could not make the namespaces of {hostname}")
            time.sleep(0.01)
        self.namespace = _net_namespace(self.pid)

    def enter(self, *, uts: bool = True, mount: bool = True) -> list[str]:
        """The ``nsenter`` prefix that runs a command inside these namespaces."""
        return ["nsenter", "-t", str(self.pid), "-n"] + (["-u"] if uts else []) + (
            ["-m"] if mount else [])

    def sh(self, *command: str) -> None:
        subprocess.run(self.enter() + list(command), check=True, capture_output=True)

    def pids(self) -> list[int]:
        """Every process in these namespaces but the anchor itself."""
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.pid and \
                    _net_namespace(int(entry)) == self.namespace:
                found.append(int(entry))
        return found

    def close(self) -> None:
        for pid in self.pids():
            _kill(pid)
        self.process.kill()
        self.process.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Host:
    """One host: its address, its name, its link, its processes."""

    def __init__(self, hosts: Hosts, index: int, *, second_interface: bool,
                 local_dir: str | None) -> None:
        self.index = index
        self.name = f"rr-h{index}"
        self.address = f"{FIRST_NET}.{index + 1}"
        self.second_address = f"{SECOND_NET}.{index + 1}" if second_interface else None
        self.local_dir = local_dir
        self._switch = hosts.switch
        self.anchor = _Anchor(self.name)
        self._port = f"p{index}"  # the switch's end of the link
        self._link(self._port, "eth0", "br0", self.address)
        if second_interface:
            self._link(f"q{index}", "eth1", "br1", self.second_address)
        if local_dir:
            Path(local_dir).mkdir(parents=True, exist_ok=True)
            self.anchor.sh("mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", local_dir)
        self.processes: list[subprocess.Popen] = []
        self._ray_dir: Path | None = None

    def _link(self, port: str, name: str, bridge: str, address: str) -> None:
        """A veth pair made in the switch: ``port`` on ``bridge``, the other end moved here."""
        switch = self._switch
        switch.sh("ip", "link", "add", port, "type", "veth", "peer", "name", f"{port}h")
        switch.sh("ip", "link", "set", f"{port}h", "netns", str(self.anchor.pid))
        switch.sh("ip", "link", "set", port, "master", bridge, "up")
        self.anchor.sh("ip", "link", "set", f"{port}h", "name", name)
        self.anchor.sh("ip", "addr", "add", f"{address}/24", "dev", name)
        self.anchor.sh("ip", "link", "set", name, "up")

    def private_ray_dir(self, directory: Path) -> None:
        """``directory`` mounted at /tmp/ray inside this host: its Ray sessions, sockets and
        logs are its own, as on a host of its own (Ray's node processes of two hosts cannot
        share /tmp/ray: their sockets and ``session_latest`` clash). Once per host."""
        if self._ray_dir == directory:
            return
        self._ray_dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        Path("/tmp/ray").mkdir(exist_ok=True)
        self.anchor.sh("mount", "--bind", str(directory), "/tmp/ray")

    # ------------------------------------------------------------------ commands
    def command(self, argv: Sequence[str]) -> list[str]:
        return self.anchor.enter() + list(argv)

    def run(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
            **popen) -> subprocess.Popen:
        """Start ``argv`` inside this host (its processes are killed with it)."""
        env = {**(os.environ if env is None else env), OWNER_VARIABLE: str(os.getpid())}
        process = subprocess.Popen(self.command(argv), env=env, stdin=subprocess.DEVNULL,
                                   **popen)
        self.processes.append(process)
        return process

    def check(self, argv: Sequence[str], *, env: dict[str, str] | None = None,
              timeout: float = 60) -> str:
        """Run ``argv`` inside this host to the end; its output (raises on failure)."""
        done = subprocess.run(self.command(argv), env=env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        if done.returncode:
            raise RuntimeError(f"{self.name}: {' '.join(argv)} exited {done.returncode}: "
                               f"{done.stderr.strip()[-2000:]}")
        return done.stdout

    # ------------------------------------------------------------------ faults
    def limit_rate(self, *, gbit: float) -> None:
        """Both directions of this host's link at ``gbit`` Gbit/s (tc tbf at each end)."""
        rate_bytes = gbit * 1e9 / 8
        burst = max(int(rate_bytes / 250), 64 * 1024)  # a 4 ms bucket, at least 64 KiB
        spec = ["tbf", "rate", f"{gbit * 1000:.0f}mbit", "burst", str(burst),
                "latency", "50ms"]
        for where, device in ((self.anchor, "eth0"), (self._switch, self._port)):
            where.sh("tc", "qdisc", "replace", "dev", device, "root", *spec)

    def partition(self) -> None:
        """Cut this host's link (it lives on, unreachable)."""
        self._switch.sh("ip", "link", "set", self._port, "down")

    def heal(self) -> None:
        """Its link back."""
        self._switch.sh("ip", "link", "set", self._port, "up")

    def cut_from(self, other: Host) -> None:
        """Partition this host from ``other`` alone (both keep every other link): a
        blackhole route for each other's address on each side."""
        self.anchor.sh("ip", "route", "add", "blackhole", f"{other.address}/32")
        other.anchor.sh("ip", "route", "add", "blackhole", f"{self.address}/32")

    def rejoin(self, other: Host) -> None:
        """Undo :meth:`cut_from`."""
        self.anchor.sh("ip", "route", "del", "blackhole", f"{other.address}/32")
        other.anchor.sh("ip", "route", "del", "blackhole", f"{self.address}/32")

    def sent_bytes(self, interface: str = "eth0") -> int:
        """Bytes this host has sent on ``interface``."""
        (link,) = json.loads(self.check(["ip", "-s", "-j", "link", "show", "dev", interface]))
        return int(link["stats64"]["tx"]["bytes"])

    def resolve_name_to(self, address: str) -> None:
        """This host's own name resolves to ``address`` here (a private /etc/hosts in its
        mount namespace), as on hosts whose name maps to another interface."""
        hosts_file = Path(f"/tmp/ringray-hosts-{os.getpid()}-{self.index}")
        hosts_file.write_text(f"127.0.0.1 localhost\n{address} {self.name}\n")
        self.anchor.sh("mount", "--bind", str(hosts_file), "/etc/hosts")
        hosts_file.unlink()  # the mount keeps it

    def pids(self) -> list[int]:
        return self.anchor.pids()

    def runs(self, text: str) -> bool:
        """Whether a process of this host has ``text`` in its command line (Ray names an
        actor's process ``ray::<Class>``)."""
        for pid in self.pids():
            try:
                if text in Path(f"/proc/{pid}/cmdline").read_text():
                    return True
            except OSError:
                continue
        return False

    def kill(self) -> None:
        """Every process of this host, at once (a power cut; the host's namespaces stay)."""
        for pid in self.pids():
            _kill(pid)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        self.kill()
        self.anchor.close()


class Hosts:
    """``count`` hosts on one bridge (a context manager that removes them all)."""

    def __init__(self, count: int, *, second_interface: Sequence[int] = (),
                 local_dirs: dict[int, str] | None = None) -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"count: {count} hosts; 1 to 200 fit one /24")
        self.count = count
        self._second = set(second_interface)
        self._local = local_dirs or {}
        self.switch: _Anchor | None = None
        self.hosts: list[Host] = []
        self._ray_logs = Path(".")
        self._ray_processes: list[tuple[Host, subprocess.Popen]] = []

    def __enter__(self) -> Hosts:
        why = hosts_unavailable()
        if why:
            raise RuntimeError(why)
        sweep_orphans()
        try:
            self.switch = _Anchor("rr-switch")
            for bridge in ("br0",) + (("br1",) if self._second else ()):
                self.switch.sh("ip", "link", "add", bridge, "type", "bridge")
                self.switch.sh("ip", "link", "set", bridge, "up")
            for index in range(self.count):
                self.hosts.append(Host(self, index, second_interface=index in self._second,
                                       local_dir=self._local.get(index)))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def close(self) -> None:
        for host in self.hosts:
            host.close()
        if self.switch is not None:
            self.switch.close()
        self.hosts, self.switch = [], None

    # ------------------------------------------------------------------ Ray
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{RAY_PORT}"

    def environment(self, **extra: str) -> dict[str, str]:
        """The environment for Ray and ringray on the hosts: multi-node Ray allowed (the
        suite's conftest keeps the local ``Cluster`` on loopback with the opposite value),
        no auth token, fast node-death detection."""
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env[OWNER_VARIABLE] = str(os.getpid())
        env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="disabled",
                   RAY_USAGE_STATS_ENABLED="0", PATH=f"{VENV_BIN}:{env.get('PATH', '')}")
        env.update(extra)
        return env

    def start_ray(self, *, slots: dict[int, int], log_dir: Path,
                  resources: dict[int, dict[str, float]] | None = None,
                  head_cpus: int = 0, timeout: float = 90) -> None:
        """``ray start`` on the head (``head_cpus`` CPUs: no worker slots by default) and on
        each host of ``slots`` (index → CPU slots, with ``resources`` of their own), each in
        the foreground of its own process; returns once every node is alive in the head's
        view."""
        self._ray_logs = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # The head keeps the machine's /tmp/ray: a driver that joins only its network
        # namespace (benchmarks/recovery_hosts.py) must find the head's raylet socket there.
        head = self.head.run([str(VENV_BIN / "ray"), "start", "--head",
                              f"--node-ip-address={self.head.address}", f"--port={RAY_PORT}",
                              f"--num-cpus={head_cpus}", "--include-dashboard=false",
                              f"--system-config={HEALTH_CHECKS}", *RAY_START_COMMON],
                             env=self.environment(), stdout=open(log_dir / "ray-h0.log", "w"),
                             stderr=subprocess.STDOUT)
        self._ray_processes.append((self.head, head))
        self._wait_for_head(self.environment(), timeout)
        for index, count in slots.items():
            self.start_worker(self.hosts[index], slots=count,
                              resources=(resources or {}).get(index), log_dir=log_dir)
        self.wait_for_nodes(1 + len(slots), timeout=timeout, starting=True)

    def start_worker(self, host: Host, *, slots: int, log_dir: Path,
                     resources: dict[str, float] | None = None) -> None:
        """``ray start`` of a worker node on ``host``, joining the head (not waited for)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        host.private_ray_dir(log_dir / f"ray-h{host.index}")
        argv = [str(VENV_BIN / "ray"), "start", f"--address={self.ray_address}",
                f"--node-ip-address={host.address}", f"--num-cpus={slots}",
                *RAY_START_COMMON]
        if resources:
            argv.append(f"--resources={json.dumps(resources)}")
        self._ray_processes.append((host, host.run(
            argv, env=self.environment(), stdout=open(log_dir / f"ray-h{host.index}.log", "w"),
            stderr=subprocess.STDOUT)))

    def _check_ray_processes(self) -> None:
        """Raise with its log's tail if a host's ``ray start`` has exited."""
        for host, process in self._ray_processes:
            if process.poll() is not None:
                log = self._ray_logs / f"ray-h{host.index}.log"
                tail = log.read_text()[-1500:] if log.exists() else ""
                raise RuntimeError(f"{host.name}: ray start exited {process.returncode}: "
                                   f"{tail}")

    def _wait_for_head(self, env: dict[str, str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        probe = (f"import socket; socket.create_connection(('{self.head.address}', "
                 f"{RAY_PORT}), 1).close()")
        while True:
            done = subprocess.run(self.head.command([sys.executable, "-c", probe]),
                                  capture_output=True, env=env)
            if done.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the head's Ray did not start listening")
            time.sleep(0.5)

    def alive_nodes(self) -> int:
        script = (f"import ray; ray.init(address='{self.ray_address}', logging_level='ERROR'); "
                  "print('alive', sum(n['Alive'] for n in ray.nodes()))")
        out = self.head.check([sys.executable, "-c", script], env=self.environment())
        return int(next(line for line in out.splitlines() if line.startswith("alive "))[6:])

    def wait_for_nodes(self, count: int, *, timeout: float = 90,
                       starting: bool = False) -> None:
        """Until the head sees ``count`` live nodes (``starting``: every ``ray start``
        must still run)."""
        deadline = time.monotonic() + timeout
        while True:
            if starting:
                self._check_ray_processes()
            try:
                if self.alive_nodes() >= count:
                    return
            except RuntimeError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {count} Ray nodes alive after {timeout:.0f} s")
            time.sleep(1)
