"""Emulated hosts on one machine: network namespaces joined by a bridge, with shaped links.

    with emulated_cluster(2, LinkShape(rate_mbit=500)) as cluster:
        env = cluster.gloo_env(1, master_port=29500)
        subprocess.run(cluster.command(1, [sys.executable, "launch/worker.py"], env))

Host i is the namespace `<prefix>h<i>` with one veth `veth<i>` at 192.0.2.(10+i)/24 (a range
reserved for documentation, so nothing here can reach a real network); the other end of each veth
(`port<i>`) hangs on the bridge `br0` in the switch namespace `<prefix>sw`. A `LinkShape` is a
host's NIC: its rate limits both what the host sends (on its veth) and what it receives (on its
switch port), and its delay is added once per direction, so host-to-host round trips take
2 * delay_ms more.

The command lists are pure (`setup_commands`, `teardown_commands`) so they are testable without
root; `emulated_cluster` runs them and deletes every namespace on every way out of the block.
Needs root and iproute2 (`ip`, `tc`); `available()` says whether, and if not, why.
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Mapping

BRIDGE = "br0"
SUBNET = "192.0.2.0/24"
_FIRST_HOST = 10                      # host i is 192.0.2.(10 + i)
MAX_HOSTS = 254 - _FIRST_HOST + 1
_COMMAND_TIMEOUT_S = 30.0
# Namespaces this module names: tw<pid>c<n> then sw, h<i> or probe. The pid lets
# `remove_stale_namespaces` find those of a process that died without cleaning up (SIGKILL).
_NAME = re.compile(r"^tw(\d+)c\d+(?:sw|h\d+|probe)$")
_counter = itertools.count()


class EmulationError(RuntimeError):
    """A command that builds or probes the emulated network failed; names it and its stderr."""


@dataclass(frozen=True)
class LinkShape:
    """A host's link: rate in Mbit/s (None: unshaped) and one-way delay in milliseconds."""

    rate_mbit: float | None
    delay_ms: float = 0.0

    def __post_init__(self):
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive or None, got {self.rate_mbit}")
        if not self.delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def shaped(self) -> bool:
        return self.rate_mbit is not None or self.delay_ms > 0

    @property
    def qdisc_kinds(self) -> tuple[str, ...]:
        """The kernel qdiscs this shape needs (netem is often missing from minimal kernels)."""
        kinds = []
        if self.delay_ms > 0:
            kinds.append("netem")
        if self.rate_mbit is not None:
            kinds.append("tbf")
        return tuple(kinds)


@dataclass(frozen=True)
class EmulatedHost:
    namespace: str
    address: str
    ifname: str


# --- pure: names and commands -------------------------------------------------------------------

def new_prefix() -> str:
    """Unique per process and per call, so nested or successive clusters never share a name."""
    return f"tw{os.getpid()}c{next(_counter)}"


def switch_namespace(prefix: str) -> str:
    return f"{prefix}sw"


def host_layout(hosts: int, prefix: str) -> tuple[EmulatedHost, ...]:
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be in 1..{MAX_HOSTS} (one /24), got {hosts}")
    return tuple(EmulatedHost(namespace=f"{prefix}h{i}", address=f"192.0.2.{_FIRST_HOST + i}",
                              ifname=f"veth{i}") for i in range(hosts))


def _rate(rate_mbit: float) -> str:
    return f"{round(rate_mbit * 1e6)}bit"


def tbf_args(rate_mbit: float) -> list[str]:
    # tbf needs a bucket of at least one packet; veth hands it GSO packets of up to 64 KiB, and a
    # bucket of about 2 ms at the rate keeps the average on the rate without long line-rate bursts.
    # The queue holds 50 ms so that TCP sees few drops at the shaped rate.
    burst = max(64 * 1024, round(rate_mbit * 1e6 / 8 * 0.002))
    return ["tbf", "rate", _rate(rate_mbit), "burst", str(burst), "latency", "50ms"]


def egress_qdisc(link: LinkShape) -> list[str] | None:
    """What follows `tc qdisc add dev X root` on a host's veth, or None when unshaped."""
    if link.delay_ms > 0:
        # netem alone does delay and rate; its queue must hold a bandwidth-delay product of
        # packets (the default 1,000 is too few at high rates and delays).
        args = ["netem", "delay", f"{link.delay_ms:g}ms", "limit", "100000"]
        if link.rate_mbit is not None:
            args += ["rate", _rate(link.rate_mbit)]
        return args
    if link.rate_mbit is not None:
        return tbf_args(link.rate_mbit)
    return None


def setup_commands(hosts: int, link: LinkShape, prefix: str) -> list[list[str]]:
    """Commands (argv lists, in order) that build the cluster. Nothing is ever created in the
    calling namespace: each veth is made in the switch namespace with its peer in the host's."""
    sw = switch_namespace(prefix)
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        # A bridge's namespace is fixed at creation, so it is created where it lives.
        ["ip", "-n", sw, "link", "add", "name", BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]
    egress = egress_qdisc(link)
    for i, h in enumerate(host_layout(hosts, prefix)):
        port = f"port{i}"
        cmds += [
            ["ip", "netns", "add", h.namespace],
            ["ip", "-n", h.namespace, "link", "set", "lo", "up"],
            ["ip", "-n", sw, "link", "add", "name", port, "type", "veth",
             "peer", "name", h.ifname, "netns", h.namespace],
            ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.ifname],
            ["ip", "-n", h.namespace, "link", "set", h.ifname, "up"],
        ]
        if egress is not None:
            cmds.append(["tc", "-n", h.namespace, "qdisc", "add", "dev", h.ifname, "root", *egress])
        if link.rate_mbit is not None:
            # What the bridge sends to this host: the host's download rate.
            cmds.append(["tc", "-n", sw, "qdisc", "add", "dev", port, "root",
                         *tbf_args(link.rate_mbit)])
    return cmds


def rate_commands(hosts: int, rate_mbit: float, prefix: str) -> list[list[str]]:
    """Commands that set every host's link, both ways, to `rate_mbit` (tbf, replacing what is
    there): a run can set up at one rate and measure at another."""
    sw = switch_namespace(prefix)
    cmds = []
    for i, h in enumerate(host_layout(hosts, prefix)):
        cmds += [["tc", "-n", h.namespace, "qdisc", "replace", "dev", h.ifname, "root",
                  *tbf_args(rate_mbit)],
                 ["tc", "-n", sw, "qdisc", "replace", "dev", f"port{i}", "root",
                  *tbf_args(rate_mbit)]]
    return cmds


def teardown_commands(hosts: int, prefix: str) -> list[list[str]]:
    """Deleting a namespace deletes its interfaces (and so both ends of each veth)."""
    names = [h.namespace for h in host_layout(hosts, prefix)] + [switch_namespace(prefix)]
    return [["ip", "netns", "del", n] for n in names]


def link_commands(host: EmulatedHost, up: bool) -> list[list[str]]:
    """Commands that take a host's link down (a pulled cable: its switch port loses carrier and
    nothing reaches it or leaves it) or bring it back. Addresses stay, and TCP connections
    survive an outage shorter than their retransmission limit."""
    return [["ip", "-n", host.namespace, "link", "set", host.ifname, "up" if up else "down"]]


def netns_exec(namespace: str, argv: list[str], env: Mapping[str, str] | None = None) -> list[str]:
    """argv run inside `namespace`, with `env` added to the environment it inherits."""
    assignments = [f"{k}={v}" for k, v in (env or {}).items()]
    return ["ip", "netns", "exec", namespace, *(["env", *assignments] if assignments else []),
            *argv]


# --- running them -------------------------------------------------------------------------------

def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise EmulationError(f"`{shlex.join(argv)}` could not run: {e}") from e
    if r.returncode != 0:
        detail = r.stderr.strip() or r.stdout.strip() or "(no output)"
        hint = ""
        if "qdisc kind is unknown" in detail:
            hint = " (this kernel lacks that qdisc; available(link) checks for it)"
        raise EmulationError(f"`{shlex.join(argv)}` failed (exit {r.returncode}): {detail}{hint}")
    return r


def _delete_namespaces(cmds: list[list[str]]) -> list[str]:
    """Run `ip netns del` commands, skipping namespaces already gone; never raises (it runs on
    the way out of errors it must not mask). Returns the failures, if any."""
    failures = []
    for argv in cmds:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            failures.append(f"`{shlex.join(argv)}`: {e}")
            continue
        if r.returncode != 0 and "No such file or directory" not in r.stderr:
            failures.append(f"`{shlex.join(argv)}`: {r.stderr.strip()}")
    return failures


def list_namespaces() -> list[str]:
    r = _run(["ip", "netns", "list"])
    # Lines read "name" or "name (id: 3)".
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete namespaces this module made in processes that no longer run (killed before they
    could clean up); returns their names."""
    stale = [n for n in list_namespaces()
             if (m := _NAME.match(n)) and not _alive(int(m.group(1)))]
    _delete_namespaces([["ip", "netns", "del", n] for n in stale])
    return stale


def available(link: LinkShape | None = None) -> tuple[bool, str]:
    """(True, "") when emulated clusters (with `link`'s qdiscs, if given) can be built here, else
    (False, why): the reason is meant for skip messages and for falling back to loopback."""
    if not hasattr(os, "geteuid") or not os.path.isdir("/proc/self/ns"):
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    probe = f"{new_prefix()}probe"
    try:
        _run(["ip", "netns", "add", probe])
    except EmulationError as e:
        return False, str(e)
    try:
        _run(["ip", "-n", probe, "link", "add", "name", "probe0", "type", "veth",
              "peer", "name", "probe1"])
        _run(["ip", "-n", probe, "link", "add", "name", "probebr", "type", "bridge"])
        for kind in (link.qdisc_kinds if link else ()):
            args = egress_qdisc(LinkShape(None, 1.0)) if kind == "netem" else tbf_args(100.0)
            _run(["tc", "-n", probe, "qdisc", "replace", "dev", "probe0", "root", *args])
    except EmulationError as e:
        return False, str(e)
    finally:
        _delete_namespaces([["ip", "netns", "del", probe]])
    return True, ""


@dataclass(frozen=True)
class EmulatedCluster:
    hosts: tuple[EmulatedHost, ...]
    link: LinkShape
    prefix: str

    @property
    def namespaces(self) -> list[str]:
        return [h.namespace for h in self.hosts] + [switch_namespace(self.prefix)]

    def command(self, host_index: int, argv: list[str],
                env: Mapping[str, str] | None = None) -> list[str]:
        """argv to run on host `host_index` (e.g. with subprocess.Popen)."""
        return netns_exec(self.hosts[host_index].namespace, argv, env)

    def set_link(self, host_index: int, up: bool) -> None:
        """Cut host `host_index`'s link (up=False) or restore it (see `link_commands`)."""
        for argv in link_commands(self.hosts[host_index], up):
            _run(argv)

    def set_rate(self, rate_mbit: float) -> None:
        """Every host's link at `rate_mbit` from now on (see `rate_commands`); no delay is
        kept (a netem link is replaced by tbf)."""
        for argv in rate_commands(len(self.hosts), rate_mbit, self.prefix):
            _run(argv)

    def gloo_env(self, host_index: int, master_port: int | None = None) -> dict[str, str]:
        """Environment for a gloo process on host `host_index`: gloo binds to that host's veth
        (not loopback, which every namespace has), and the rendezvous is on host 0."""
        env = {"GLOO_SOCKET_IFNAME": self.hosts[host_index].ifname,
               "MASTER_ADDR": self.hosts[0].address}
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        return env


class _Cleanup:
    """Deletes the namespaces once, whichever comes first: the block's end, SIGTERM, or exit."""

    def __init__(self, teardown: list[list[str]]):
        self.teardown = teardown
        self.done = False
        self.running = False
        self.pending_signal: int | None = None
        self.previous = None
        self.installed = False

    def run(self) -> list[str]:
        if self.done or self.running:
            return []
        self.running = True
        try:
            return _delete_namespaces(self.teardown)
        finally:
            self.running = False
            self.done = True

    def install(self) -> None:
        atexit.register(self.run)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_IGN:
            return  # the process chose to outlive SIGTERM; the block's end cleans up
        self.previous = previous
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.installed = True

    def _on_sigterm(self, signum, frame):
        if self.running:
            # Arrived during teardown: let it finish, then deliver the signal (see `close`).
            self.pending_signal = signum
            return
        self.run()
        previous = self.restore()
        if callable(previous):
            previous(signum, frame)
        else:
            # Default action is to die; unwinding instead lets the caller's own cleanup
            # (killing its subprocesses, say) run as well.
            raise SystemExit(128 + signum)

    def restore(self):
        previous = self.previous
        if self.installed:
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, previous)
            self.installed = False
        return previous

    def close(self) -> list[str]:
        failures = self.run()
        self.restore()
        atexit.unregister(self.run)
        if self.pending_signal is not None:
            os.kill(os.getpid(), self.pending_signal)
        return failures


@contextmanager
def emulated_cluster(hosts: int, link: LinkShape = LinkShape(None),
                     prefix: str | None = None) -> Iterator[EmulatedCluster]:
    """Build `hosts` emulated hosts joined by a switch with `link` on every host, yield them, and
    delete every namespace on the way out (normal exit, exception, Ctrl-C, SIGTERM, exit)."""
    prefix = prefix or new_prefix()
    setup = setup_commands(hosts, link, prefix)
    teardown = teardown_commands(hosts, prefix)
    # Teardown deletes every name it planned, so none may belong to someone else.
    taken = sorted({argv[-1] for argv in teardown} & set(list_namespaces()))
    if taken:
        raise EmulationError(f"namespaces already exist: {', '.join(taken)} (left by a killed "
                             "run? remove_stale_namespaces() deletes those of dead processes)")
    cleanup = _Cleanup(teardown)
    # Installed before the first namespace exists, so a signal during setup also cleans up.
    cleanup.install()
    try:
        for argv in setup:
            _run(argv)
        yield EmulatedCluster(hosts=host_layout(hosts, prefix), link=link, prefix=prefix)
    finally:
        failures = cleanup.close()
        if failures:
            warnings.warn("emulated cluster teardown left: " + "; ".join(failures),
                          RuntimeWarning, stacklevel=2)


__all__ = ["EmulatedCluster", "EmulatedHost", "EmulationError", "LinkShape", "available",
           "emulated_cluster", "egress_qdisc", "host_layout", "link_commands", "list_namespaces",
           "netns_exec", "new_prefix", "rate_commands", "remove_stale_namespaces",
           "setup_commands", "switch_namespace", "tbf_args", "teardown_commands"]
