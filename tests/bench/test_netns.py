"""Emulated hosts in network namespaces: the command lists (pure), and real clusters where this
machine allows them (root, iproute2): reachability, teardown on every way out, gloo across hosts."""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

from tilework.bench import netns
from tilework.bench.netns import (
    EmulatedCluster,
    EmulationError,
    LinkShape,
    available,
    egress_qdisc,
    emulated_cluster,
    host_layout,
    list_namespaces,
    new_prefix,
    setup_commands,
    switch_namespace,
    teardown_commands,
)

AVAILABLE, WHY = available()
needs_netns = pytest.mark.skipif(not AVAILABLE, reason=f"no emulated cluster here: {WHY}")


# --- pure -------------------------------------------------------------------------------------

def test_layout_names_and_addresses():
    hosts = host_layout(3, "twXc0")
    assert [h.namespace for h in hosts] == ["twXc0h0", "twXc0h1", "twXc0h2"]
    assert [h.address for h in hosts] == ["192.0.2.10", "192.0.2.11", "192.0.2.12"]
    assert [h.ifname for h in hosts] == ["veth0", "veth1", "veth2"]
    subnet = ipaddress.ip_network(netns.SUBNET)
    assert all(ipaddress.ip_address(h.address) in subnet for h in host_layout(netns.MAX_HOSTS, "p"))
    with pytest.raises(ValueError, match="hosts"):
        host_layout(0, "p")
    with pytest.raises(ValueError, match="hosts"):
        host_layout(netns.MAX_HOSTS + 1, "p")


def test_prefixes_are_unique_and_found_again_when_stale():
    a, b = new_prefix(), new_prefix()
    assert a != b and a.startswith(f"tw{os.getpid()}c")
    for name in [switch_namespace(a), *(h.namespace for h in host_layout(2, a)), f"{a}probe"]:
        assert int(netns._NAME.match(name).group(1)) == os.getpid()
    assert netns._NAME.match("mynetns") is None


def test_setup_builds_switch_bridge_and_one_veth_per_host():
    cmds = setup_commands(2, LinkShape(None), "p")
    assert cmds[0] == ["ip", "netns", "add", "psw"]
    # The bridge is created inside the switch namespace and never moved.
    assert ["ip", "-n", "psw", "link", "add", "name", "br0", "type", "bridge"] in cmds
    assert not any("netns" in c and "br0" in c and c[:2] != ["ip", "-n"] for c in cmds)
    for i in range(2):
        assert ["ip", "-n", "psw", "link", "add", "name", f"port{i}", "type", "veth",
                "peer", "name", f"veth{i}", "netns", f"ph{i}"] in cmds
        assert ["ip", "-n", "psw", "link", "set", f"port{i}", "master", "br0"] in cmds
        assert ["ip", "-n", f"ph{i}", "addr", "add", f"192.0.2.{10 + i}/24", "dev",
                f"veth{i}"] in cmds
        assert ["ip", "-n", f"ph{i}", "link", "set", f"veth{i}", "up"] in cmds
    # Nothing is created or configured in the calling namespace.
    assert all(c[:3] == ["ip", "netns", "add"] or c[1] == "-n" for c in cmds)
    added = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert added == ["psw", "ph0", "ph1"]
    for ns in added:
        assert ["ip", "-n", ns, "link", "set", "lo", "up"] in cmds
        # Each namespace is added before anything is done in it.
        first_use = min(i for i, c in enumerate(cmds) if c[1:3] == ["-n", ns])
        assert cmds.index(["ip", "netns", "add", ns]) < first_use
    assert not any(c[0] == "tc" for c in cmds)


def qdiscs(cmds):
    return {c[2] + ":" + c[6]: c[8:] for c in cmds if c[0] == "tc"}


def test_rate_shapes_each_host_up_and_down_with_tbf():
    q = qdiscs(setup_commands(2, LinkShape(rate_mbit=100), "p"))
    assert set(q) == {"ph0:veth0", "ph1:veth1", "psw:port0", "psw:port1"}
    for args in q.values():
        assert args[:3] == ["tbf", "rate", "100000000bit"]
        assert "burst" in args and "latency" in args
        assert int(args[args.index("burst") + 1]) >= 64 * 1024


def test_delay_uses_netem_on_the_host_side_only():
    assert egress_qdisc(LinkShape(None)) is None
    assert egress_qdisc(LinkShape(None, delay_ms=2.5))[:3] == ["netem", "delay", "2.5ms"]
    q = qdiscs(setup_commands(2, LinkShape(rate_mbit=500, delay_ms=1), "p"))
    for i in range(2):
        host = q[f"ph{i}:veth{i}"]
        assert host[:3] == ["netem", "delay", "1ms"]
        assert host[host.index("rate") + 1] == "500000000bit"
        assert q[f"psw:port{i}"][0] == "tbf"
    assert set(qdiscs(setup_commands(2, LinkShape(None, 1), "p"))) == {"ph0:veth0", "ph1:veth1"}


def test_link_shape_checks_values():
    assert not LinkShape(None).shaped and LinkShape(None, 1).shaped and LinkShape(10).shaped
    assert LinkShape(10, 1).qdisc_kinds == ("netem", "tbf")
    for bad in [dict(rate_mbit=0), dict(rate_mbit=-1), dict(rate_mbit=None, delay_ms=-1)]:
        with pytest.raises(ValueError):
            LinkShape(**bad)


def test_teardown_deletes_every_namespace_setup_adds():
    added = {c[3] for c in setup_commands(3, LinkShape(10), "p") if c[:3] == ["ip", "netns", "add"]}
    deleted = teardown_commands(3, "p")
    assert all(c[:3] == ["ip", "netns", "del"] for c in deleted)
    assert {c[3] for c in deleted} == added


def test_command_and_gloo_env():
    c = EmulatedCluster(hosts=host_layout(2, "p"), link=LinkShape(None), prefix="p")
    assert c.command(1, ["python", "-c", "1"]) == [
        "ip", "netns", "exec", "ph1", "python", "-c", "1"]
    assert c.command(0, ["x"], {"A": "1", "B": "two words"}) == [
        "ip", "netns", "exec", "ph0", "env", "A=1", "B=two words", "x"]
    assert c.gloo_env(1) == {"GLOO_SOCKET_IFNAME": "veth1", "MASTER_ADDR": "192.0.2.10"}
    assert c.gloo_env(0, master_port=29500)["MASTER_PORT"] == "29500"
    assert c.namespaces == ["ph0", "ph1", "psw"]


# --- real namespaces ----------------------------------------------------------------------------

@pytest.fixture
def no_leftovers():
    """Fails a test that leaves any namespace of this process behind (and removes them)."""
    yield
    mine = f"tw{os.getpid()}c"
    left = [n for n in list_namespaces() if n.startswith(mine)]
    for n in left:
        subprocess.run(["ip", "netns", "del", n], capture_output=True)
    assert not left, f"namespaces left behind: {left}"


def present(names):
    return set(names) & set(list_namespaces())


CONNECT = textwrap.dedent("""
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], 9), timeout=2).close()
    except ConnectionRefusedError:
        pass  # the host answered (a reset): reachable, nothing listens on port 9
""")


def reach(cluster, src, dst):
    """ping if installed; else a TCP connect, which a reset from the peer also proves."""
    address = cluster.hosts[dst].address
    if netns.shutil.which("ping"):
        argv = ["ping", "-c", "1", "-W", "2", address]
    else:
        argv = [sys.executable, "-c", CONNECT, address]
    return subprocess.run(cluster.command(src, argv), capture_output=True, text=True, timeout=10)


@needs_netns
def test_two_hosts_reach_each_other_and_vanish_after(no_leftovers):
    before = signal.getsignal(signal.SIGTERM)
    with emulated_cluster(2, LinkShape(None)) as c:
        names = c.namespaces
        assert present(names) == set(names)
        for src, dst in [(0, 1), (1, 0)]:
            r = reach(c, src, dst)
            assert r.returncode == 0, r.stdout + r.stderr
        show = subprocess.run(c.command(0, ["ip", "-4", "addr", "show", "dev", "veth0"]),
                              capture_output=True, text=True, check=True).stdout
        assert "192.0.2.10/24" in show
        # Only loopback and its veth: the host cannot see this machine's interfaces.
        links = subprocess.run(c.command(0, ["ip", "-o", "link"]), capture_output=True,
                               text=True, check=True).stdout
        assert [line.split(":")[1].strip().split("@")[0] for line in links.splitlines()] == [
            "lo", "veth0"]
    assert not present(names)
    assert signal.getsignal(signal.SIGTERM) == before


@needs_netns
def test_set_rate_reshapes_both_ends_of_every_link(no_leftovers):
    """A run can set up unshaped and measure shaped (bench/comm_prediction.py): the rate is
    replaced on each host's veth and on its switch port, the links stay up."""
    with emulated_cluster(2, LinkShape(rate_mbit=100)) as c:
        c.set_rate(7)
        for ns, dev in [(c.hosts[0].namespace, "veth0"), (c.hosts[1].namespace, "veth1"),
                        (switch_namespace(c.prefix), "port0"),
                        (switch_namespace(c.prefix), "port1")]:
            shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in shown and "rate 7Mbit" in shown, shown
        assert reach(c, 0, 1).returncode == 0


@needs_netns
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_errors_inside_the_block_still_tear_down(error, no_leftovers):
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(error):
        with emulated_cluster(2, LinkShape(rate_mbit=100)) as c:
            names = c.namespaces
            assert present(names) == set(names)
            raise error("boom")
    assert not present(names)
    assert signal.getsignal(signal.SIGTERM) == before


@needs_netns
def test_teardown_ignores_namespaces_already_deleted(no_leftovers):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with emulated_cluster(2, LinkShape(None)) as c:
            subprocess.run(["ip", "netns", "del", c.hosts[1].namespace], check=True)
        assert not present(c.namespaces)


@needs_netns
def test_failing_command_is_named_and_nothing_is_left(no_leftovers):
    with pytest.raises(EmulationError, match=r"`ip link show dev tw-none` failed \(exit \d+\): "):
        netns._run(["ip", "link", "show", "dev", "tw-none"])
    # A delay needs netem, which minimal kernels lack: then setup fails naming the tc command.
    link = LinkShape(rate_mbit=100, delay_ms=1)
    prefix = new_prefix()
    names = [c[3] for c in teardown_commands(2, prefix)]
    if available(link)[0]:
        with emulated_cluster(2, link, prefix=prefix) as c:
            out = subprocess.run(c.command(0, ["tc", "qdisc", "show", "dev", "veth0"]),
                                 capture_output=True, text=True, check=True).stdout
            assert "netem" in out
    else:
        with pytest.raises(EmulationError, match=r"`tc -n \S+h0 qdisc add dev veth0 root netem"):
            with emulated_cluster(2, link, prefix=prefix):
                pass
    assert not present(names)


@needs_netns
def test_existing_namespace_is_refused_not_deleted(no_leftovers):
    prefix = new_prefix()
    taken = host_layout(2, prefix)[1].namespace
    subprocess.run(["ip", "netns", "add", taken], check=True)
    try:
        with pytest.raises(EmulationError, match=f"already exist: {taken}"):
            with emulated_cluster(2, LinkShape(None), prefix=prefix):
                pass
        assert present([taken]) == {taken}
        assert not present([switch_namespace(prefix), host_layout(2, prefix)[0].namespace])
    finally:
        subprocess.run(["ip", "netns", "del", taken], check=True)


@needs_netns
def test_sigterm_in_the_block_tears_down_and_calls_the_previous_handler(no_leftovers):
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with emulated_cluster(2, LinkShape(None)) as c:
            os.kill(os.getpid(), signal.SIGTERM)
            # The handler runs between bytecodes of this (main) thread; give it a moment.
            deadline = time.monotonic() + 5
            while not calls and time.monotonic() < deadline:
                time.sleep(0.01)
            assert calls == [signal.SIGTERM]
            assert not present(c.namespaces)
        os.kill(os.getpid(), signal.SIGTERM)  # the previous handler is back
        time.sleep(0.05)
        assert calls == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


@needs_netns
def test_stale_namespaces_of_dead_processes_are_removed(no_leftovers):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    stale, live = f"tw{int(dead.stdout)}c0h0", f"{new_prefix()}h0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert stale in netns.remove_stale_namespaces()
        assert present([stale, live]) == {live}
    finally:
        netns._delete_namespaces([["ip", "netns", "del", n] for n in (stale, live)])


HOLD = textwrap.dedent("""
    import sys, time
    from tilework.bench.netns import LinkShape, emulated_cluster
    with emulated_cluster(2, LinkShape(None)) as c:
        print(" ".join(c.namespaces), flush=True)
        time.sleep(60)
""")


@needs_netns
def test_sigterm_to_a_process_holding_a_cluster_removes_it():
    p = subprocess.Popen([sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True)
    names = []
    try:
        names = p.stdout.readline().split()
        assert len(names) == 3 and present(names) == set(names)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 128 + signal.SIGTERM
        assert not present(names)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        netns._delete_namespaces([["ip", "netns", "del", n] for n in names])


ALL_REDUCE = textwrap.dedent("""
    import datetime, json, os, sys, time
    import torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port}",
                            rank=rank, world_size=2, timeout=datetime.timedelta(seconds=15))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    big = torch.ones(1 << 20)                      # 4 MB of float32
    dist.all_reduce(big)                           # warm-up (connections, buffers)
    times = []
    for _ in range(3):
        big.fill_(1.0)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(big)
        times.append(time.perf_counter() - start)
    print(json.dumps({"rank": rank, "sum": t.item(), "big": big[0].item(), "times": times}))
    dist.destroy_process_group()
""")


@needs_netns
def test_gloo_all_reduce_across_two_emulated_hosts(tmp_path, no_leftovers):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    port = 29500  # free: nothing else runs in a namespace this test just made
    with emulated_cluster(2, LinkShape(rate_mbit=100)) as c:
        procs = []
        try:
            for r in range(2):
                env = {**c.gloo_env(r), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                procs.append(subprocess.Popen(c.command(r, [sys.executable, str(script), str(r),
                                                            str(port)], env),
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
            outs = [p.communicate(timeout=40) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate()
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [x["rank"] for x in results] == [0, 1]
    assert [x["sum"] for x in results] == [3.0, 3.0]
    assert [x["big"] for x in results] == [2.0, 2.0]
    best = min(results[0]["times"])
    print(f"\n4 MB gloo all_reduce, 2 emulated hosts, 100 Mbit/s links: "
          f"{[round(t * 1e3) for t in results[0]['times']]} ms "
          f"(best {best * 1e3:.0f} ms, {4 / best:.1f} MB/s algorithm bandwidth)")
