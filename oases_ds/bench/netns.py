"""A real slow link on one machine: two network namespaces joined by a tbf-shaped veth pair.

Why in the library: ``benchmarks/validate_link.py`` (does the emulator match a real
shaped link?) and ``benchmarks/e2e_shaped.py`` (the end-to-end table on such a link)
run rank processes the same way, one per namespace with gloo bound to the veth, and
both must leave nothing behind: a namespace or a qdisc that outlives its run shapes
the next one.  So creation, shaping, the rank launch and the clean-up live here once.

Everything created is named ``oasesvl<pid>a/b`` (namespaces) and ``ovl<pid>a/b``
(veth ends), addresses in 10.231.0.0/24 inside those namespaces only.  Deleting a
namespace deletes its veth end, its peer and their qdiscs, so :meth:`VethPair.__exit__`
(run on every exit path) and :func:`remove_stale` (namespaces of dead processes,
left by a run killed with SIGKILL) are enough.  Imports no torch.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from oases_ds.utils.io import write_json_atomic

NS_PREFIX = "oasesvl"
"""Every namespace this module creates is ``<NS_PREFIX><pid>a`` or ``...b``."""


def payload_fraction(mtu: int) -> float:
    """TCP payload bytes per Ethernet frame byte (IP + TCP headers with timestamps, 14-byte Ethernet header)."""
    return (mtu - 20 - 20 - 12) / (mtu + 14)


class Unavailable(RuntimeError):
    """Namespaces, veth or tc cannot be used here."""


def sh(*cmd: str) -> str:
    """Run one ``ip``/``tc`` command; a failure is :class:`Unavailable` quoting the command and its error."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise Unavailable(f"`{' '.join(cmd)}` failed: {(proc.stderr or proc.stdout).strip()}")
    return proc.stdout


def stale_namespaces(names: list[str], alive: Callable[[int], bool]) -> list[str]:
    """The names among ``names`` that this module created for a process that no longer runs.

    Pure (``alive`` answers whether a pid runs), so the choice is tested without root."""
    stale = []
    for name in names:
        m = re.fullmatch(rf"{NS_PREFIX}(\d+)[ab]", name)
        if m and not alive(int(m.group(1))):
            stale.append(name)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # runs, as another user
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces (and with them their veth ends and qdiscs) left by dead runs; return their names."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return []
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    stale = stale_namespaces(names, _pid_alive)
    for ns in stale:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return stale


class VethPair:
    """Two namespaces joined by a veth pair; ``shape(rate)`` / ``unshape()`` on both ends."""

    def __init__(self, mtu: int = 1500) -> None:
        self.mtu = mtu
        tag = f"{NS_PREFIX}{os.getpid()}"
        self.ns = (f"{tag}a", f"{tag}b")
        self.dev = (f"ovl{os.getpid()}a", f"ovl{os.getpid()}b")
        self.addr = ("10.231.0.1", "10.231.0.2")
        self.created: list[str] = []

    def __enter__(self) -> "VethPair":
        if os.geteuid() != 0:
            raise Unavailable("needs root to create network namespaces and qdiscs")
        for tool in ("ip", "tc"):
            if not shutil.which(tool):
                raise Unavailable(f"`{tool}` is not installed")
        remove_stale()
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
                self.created.append(ns)
            sh("ip", "link", "add", self.dev[0], "mtu", str(self.mtu), "type", "veth", "peer", "name", self.dev[1],
               "mtu", str(self.mtu))
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def shape(self, rate_mbit: float, burst_bytes: int) -> None:
        for ns, dev in zip(self.ns, self.dev):
            sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
               "burst", str(burst_bytes), "latency", "200ms")

    def sent(self) -> dict[str, int]:
        """Bytes and packets both tbf qdiscs have sent since shaping.  The kernel counts a GSO
        packet as its segments, and both directions (acknowledgements too) are summed, so the
        ratio is the mean *frame* on the wire, not the size of what tbf released at once."""
        total = {"bytes": 0, "packets": 0}
        for ns, dev in zip(self.ns, self.dev):
            for q in json.loads(sh("tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev, "root")):
                total["bytes"] += int(q.get("bytes", 0))
                total["packets"] += int(q.get("packets", 0))
        return total

    def unshape(self) -> None:
        for ns, dev in zip(self.ns, self.dev):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=30)

    def __exit__(self, *exc: Any) -> None:
        for ns in reversed(self.created):  # deleting a namespace deletes its veth end, and the pair with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.created.clear()


def run_ranks(pair: VethPair, script: str, spec: dict, timeout_s: float, root: str) -> list[dict]:
    """Run ``python <script> --rank-worker SPEC OUT`` once per namespace (rank 0 in the first) and
    return each rank's JSON result.  A rank that dies without a result, or a pair that runs past
    ``timeout_s``, raises ``RuntimeError``; both processes are ended either way."""
    with tempfile.TemporaryDirectory(prefix="oases-ns-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        write_json_atomic(spec_path, spec)
        port = 29500 + os.getpid() % 1000
        procs, outs = [], []
        try:
            for rank, (ns, dev) in enumerate(zip(pair.ns, pair.dev)):
                out = os.path.join(tmp, f"rank{rank}.json")
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR=pair.addr[0], MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=dev,
                           PYTHONPATH=root, OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, os.path.abspath(script),
                                               "--rank-worker", spec_path, out], env=env))
                outs.append(out)
            deadline = time.monotonic() + timeout_s
            while any(not os.path.exists(o) for o in outs):
                for p, o in zip(procs, outs):
                    if p.poll() is not None and not os.path.exists(o):
                        raise RuntimeError(f"a rank exited with {p.returncode} without a result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out after {timeout_s}s")
                time.sleep(0.1)
        finally:
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        results = []
        for o in outs:
            with open(o) as f:
                results.append(json.load(f))
    return results
