"""Hosts: each a Linux network namespace with an address of its own, joined to the others by a veth
link to one switch (a bridge in a namespace of its own: the machine's own network is untouched).
A host's processes run in its network namespace and in a UTS namespace with its host name, so what
they read as their host (os.uname().nodename) is the host's, as on separate machines; and they read
a boot id of the host's own, which is how UCX tells whether a peer shares its machine (shared
memory between the processes of one host, the host's link between hosts).

    with Hosts(["a", "b", "c"], log_dir) as hosts:
        hosts.spawn("a", "nats-a", argv, env)  # a ProcessGroup child, inside host a
        hosts.cut("c"); hosts.restore("c")      # host c's switch port goes down, and up again
        hosts.kill("b")                         # SIGKILL every process of host b

Every namespace is named `tandem-mh-<pid>-<n>-…` (pid: the test process's): runs in parallel do not
clash, and one that died without tearing down (SIGKILLed) is cleaned up by the next. Leaving stops
the processes and deletes every namespace, and with it every link, that it made.
"""

import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from shared.cli.processes import ProcessGroup

PREFIX = "tandem-mh-"
SUBNET = "10.77.0"
DEVICE = "eth0"  # each host's link as its processes see it (the workers' UCX_NET_DEVICES)
BOOT_ID = "/proc/sys/kernel/random/boot_id"
# run by `sh -c` with $0 the host name, $1 the host's boot id file, then the command
_BECOME_HOST = f'hostname "$0" && mount --bind "$1" {BOOT_ID} && shift && exec "$@"'


@dataclass(frozen=True)
class Host:
    label: str
    name: str  # its host name
    netns: str
    address: str
    port: str  # its link's end on the switch
    boot_id: Path  # a file holding its boot id

    def command(self, argv: list[str]) -> list[str]:
        """`argv`, run on this host: in its network namespace (`ip netns exec` gives it a mount
        namespace of its own too), under the host's name and boot id."""
        namespaces = ["ip", "netns", "exec", self.netns, "unshare", "--uts"]
        return [*namespaces, "sh", "-c", _BECOME_HOST, self.name, str(self.boot_id), *argv]


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """This machine's named network namespaces."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def unavailable() -> str:
    """Why hosts cannot be made here ("" when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if not shutil.which(tool):
            return f"{tool} not found (Debian: iproute2, util-linux, mount, hostname)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
        command = Host("probe", "probe", probe, "", "", Path(BOOT_ID)).command(["true"])
        subprocess.run(command, check=True, capture_output=True, timeout=30)
    except (RuntimeError, subprocess.SubprocessError) as err:
        return f"cannot make a network namespace: {err}"
    finally:
        _delete(probe)
    return ""


class Hosts:
    """Hosts `labels` (host names `host-<label>`, addresses SUBNET.1, .2, …) and their processes."""

    made = 0  # Hosts made by this process: each its own names

    def __init__(self, labels: list[str], log_dir: Path):
        Hosts.made += 1
        run = f"{PREFIX}{os.getpid()}-{Hosts.made}-"
        self.switch = run + "switch"
        self.hosts = {
            label: Host(
                label,
                f"host-{label}",
                run + label,
                f"{SUBNET}.{i + 1}",
                f"port-{label}",
                log_dir / f"boot_id-{label}",
            )
            for i, label in enumerate(labels)
        }
        self.group = ProcessGroup(log_dir)
        self._names: dict[str, list[str]] = {label: [] for label in labels}

    def __enter__(self) -> "Hosts":
        purge_dead_runs()
        try:
            self._make_switch()
            for host in self.hosts.values():
                self._make_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_switch(self) -> None:
        ip("netns", "add", self.switch)
        ip("-n", self.switch, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, host: Host) -> None:
        host.boot_id.write_text(f"{uuid.uuid4()}\n")
        ip("netns", "add", host.netns)
        ip("-n", host.netns, "link", "set", "lo", "up")
        veth = ["type", "veth", "peer", "name", DEVICE, "netns", host.netns]
        ip("-n", self.switch, "link", "add", host.port, *veth)
        ip("-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", DEVICE)
        ip("-n", host.netns, "link", "set", DEVICE, "up")

    def spawn(self, label: str, name: str, argv: list[str], env: dict[str, str]):
        """Starts `argv` on host `label` as the ProcessGroup child `name`."""
        self._names[label].append(name)
        return self.group.spawn(name, self.hosts[label].command(argv), env)

    def run(self, label: str, argv: list[str], timeout: float = 30) -> str:
        """Runs `argv` on host `label` to its end; its output."""
        done = subprocess.run(
            self.hosts[label].command(argv), capture_output=True, text=True, timeout=timeout
        )
        if done.returncode:
            raise RuntimeError(f"{argv[0]} on host {label}: {done.stderr.strip()[-2000:]}")
        return done.stdout

    def pids(self, label: str) -> list[int]:
        """The processes running on host `label`."""
        return [int(pid) for pid in ip("netns", "pids", self.hosts[label].netns).split()]

    def kill(self, label: str) -> int:
        """SIGKILLs every process of host `label`, as when it loses power; how many there were.
        The group's children among them are forgotten (they are not crashes to report)."""
        children = [(n, p) for n, p in self.group.children if n in self._names[label]]
        for _, proc in children:  # one not in the namespace yet too
            proc.kill()
        pids = set(_kill_all(self.hosts[label].netns)) | {proc.pid for _, proc in children}
        for name, proc in children:
            proc.wait(timeout=30)
            self.group.forget(name)
        return len(pids)

    def cut(self, label: str) -> None:
        """Host `label`'s link goes dark (its switch port down): nothing in, nothing out."""
        ip("-n", self.switch, "link", "set", self.hosts[label].port, "down")

    def restore(self, label: str) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[label].port, "up")

    def close(self) -> None:
        """Stops the processes (SIGTERM, then SIGKILL), then deletes every namespace made."""
        self.group.stop(grace_s=10)
        for netns in [h.netns for h in self.hosts.values()] + [self.switch]:
            _delete(netns)

    def leftovers(self) -> list[str]:
        """What is left of these hosts: their namespaces (the links live in them, and go with
        them), and any link of theirs in the test process's namespace (none is ever made there)."""
        ours = {h.netns for h in self.hosts.values()} | {self.switch}
        ports = {h.port for h in self.hosts.values()}
        return sorted(set(namespaces()) & ours) + sorted(_links() & ports)


def _links() -> set[str]:
    """The names of this (the test process's) namespace's links."""
    return {line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link").splitlines()}


def _kill_all(netns: str) -> list[int]:
    """SIGKILLs every process in `netns` and waits until none is left; their pids."""
    pids = [int(pid) for pid in ip("netns", "pids", netns).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while ip("netns", "pids", netns).split() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def _delete(netns: str) -> None:
    """Deletes `netns` (and the links in it) after killing what still runs there; gone already:
    nothing to do."""
    if netns not in namespaces():
        return
    _kill_all(netns)
    ip("netns", "delete", netns)


def purge_dead_runs() -> None:
    """Deletes the namespaces of runs whose test process is gone (SIGKILLed before tearing down)."""
    for netns in namespaces():
        if not netns.startswith(PREFIX):
            continue
        pid = netns[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _delete(netns)
