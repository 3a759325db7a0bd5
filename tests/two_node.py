"""A real two-node Ray cluster on one machine, on loopback addresses only.

Approach (docs/multinode.md has the evidence): two Ray nodes on two addresses of ``lo``
(Linux answers on all of 127.0.0.0/8 with no setup), every process, driver included,
with the repo's ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``:

* the head on ``HEAD_IP`` = 127.0.0.1, started by ``ray start --head``; a node on
  127.0.0.1 binds its gRPC servers to loopback alone, as in the repo's one-node tests;
* node 2 on ``NODE2_IP`` = 127.0.0.2 with the custom resource ``{"node2": 1}``, started
  by this file run as a script: what ``ray start --address`` does after its checks
  (``ray._private.node.Node(head=False)``, as ``ray.cluster_utils`` does). The CLI can't be
  used for it: with ``=0`` it refuses a non-head node ("Multi-node Ray clusters are not
  supported on Windows and OSX"), and with ``=1`` it rewrites the literal ``127.0.0.1``
  of ``--address`` (and the head's ``--node-ip-address``) to the machine's external
  interface address (``services.resolve_ip_for_localhost``). Node 2's servers listen on
  all interfaces (Ray binds loopback alone only for a node on 127.0.0.1); every
  connection to them is made on 127.0.0.2.

Ray's head also reaches out of the machine by itself: its dashboard process probes
cloud metadata (HTTP to 169.254.169.254, a DNS lookup of metadata.google.internal) and a
``ray start`` head reports "usage stats disabled" to usage-stats.ray.io. The nodes'
environment therefore points Ray's usage report URL and the HTTP(S) proxy at a loopback
port held closed by this process (``grpc_proxy=""`` keeps gRPC off the proxy,
``no_proxy`` lets the nodes' own addresses through), so those attempts fail at once on
loopback.

Network namespaces (one node per namespace, joined by a veth pair) are not used: the
driver, this test process, would have to live in one of them.

Every port is chosen here (free on all addresses, below the ephemeral range; also the
head's metrics ports, fixed by default), worker ports are left to the OS, each node has
its own temp dir, and each node is started in a session of its own, which teardown (and
``kill_node2``) kills whole: the daemons share the session's process group, the raylet
puts each worker in a group of its own in the same session. Start-up is polled against
a deadline.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

HEAD_IP = "127.0.0.1"
NODE2_IP = "127.0.0.2"
NODE2_RESOURCE = "node2"
CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Every process the fixture starts (and their children: daemons, workers) carries this
# in its environment; teardown finds stragglers by it (and by open files under the
# fixture's temp dir), never by a process name.
TAG_ENV = "RADIXRAY_TWO_NODE_TAG"
_MiB = 1024 ** 2


@dataclass
class TwoNodeCluster:
    """What the fixture yields; the driver is connected (``ray.init``) while it lives."""
    address: str                # GCS address "127.0.0.1:PORT"
    head_ip: str
    node2_ip: str
    head_node_id: str
    node2_node_id: str
    node2_resource: str         # custom resource only node 2 has ({"node2": 1})
    temp_root: str
    startup_s: float            # from starting the head to both nodes alive in ray.nodes()
    head_sid: int               # session id of each node's processes
    node2_sid: int
    tag: str
    dashboard_url: str          # "http://127.0.0.1:PORT" (served only with include_dashboard)
    logs: dict = field(default_factory=dict)

    def kill_node2(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> None:
        """Kill every process of node 2 (raylet, agents, workers); wait until all exited."""
        _kill_session(self.node2_sid, sig, timeout)

    def node(self, node_id: str) -> dict | None:
        """This node's entry of ``ray.nodes()`` (None if the GCS does not list it)."""
        import ray
        return next((n for n in ray.nodes() if n["NodeID"] == node_id), None)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports nobody listens on (any address), outside 32768-60999."""
    ports: list[int] = []
    held: list[socket.socket] = []
    try:
        while len(ports) < n:
            port = random.randrange(20000, 32000)
            if port in ports:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", port))  # bind only: fails if anyone listens on any address
            except OSError:
                s.close()
                continue
            held.append(s)
            ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


def _session_members(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
    return pids


def _stragglers(tag: str, temp_root: str) -> list[int]:
    """Processes, other than this one, whose environment carries our tag or that hold a
    file under ``temp_root`` open (every Ray process keeps its log files open). Both
    checks: a process that sets its title (``ray::...``) may overwrite its environment."""
    needle = f"{TAG_ENV}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
                    continue
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{entry}/fd/{fd}").startswith(temp_root + "/"):
                        pids.append(int(entry))
                        break
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill_session(sid: int, sig: int, timeout: float) -> None:
    """Signal every process of session ``sid``; SIGKILL what is left after ``timeout``."""
    live: list[int] = []
    for attempt_sig, wait_s in ((sig, timeout), (signal.SIGKILL, 30.0)):
        deadline = time.monotonic() + wait_s
        signalled: set[int] = set()
        while True:
            live = [p for p in _session_members(sid) if _alive(p)]
            if not live:
                return
            for pid in set(live) - signalled:  # once each, and any process forked meanwhile
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, attempt_sig)
                signalled.add(pid)
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    raise RuntimeError(f"processes of session {sid} survive SIGKILL: {live}")


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _start_node(cmd: list[str], env: dict, log_path: str, timeout: float) -> int:
    """Run a node's start command in a new session; return its pid, the session id."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    if rc != 0:
        _kill_session(proc.pid, signal.SIGKILL, 10)
        proc.wait()
        why = f"timed out after {timeout}s" if rc is None else f"exited {rc}"
        raise RuntimeError(f"{cmd[:3]} {why}:\n{_tail(log_path)}")
    return proc.pid


def _ray_cli() -> list[str]:
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    return [ray_bin] if os.path.exists(ray_bin) else [shutil.which("ray") or "ray"]


def _node_env(tag: str, closed_port: int, metric_ports: list[int], extra: dict | None) -> dict:
    nowhere = f"http://127.0.0.1:{closed_port}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "all_proxy", "ALL_PROXY")}
    env.update({
        CLUSTER_ENV: "0", "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0", "RAY_USAGE_STATS_REPORT_URL": f"{nowhere}/",
        "http_proxy": nowhere, "https_proxy": nowhere, "HTTP_PROXY": nowhere,
        "HTTPS_PROXY": nowhere, "grpc_proxy": "",
        "no_proxy": f"localhost,{HEAD_IP},{NODE2_IP},::1",
        "NO_PROXY": f"localhost,{HEAD_IP},{NODE2_IP},::1",
        # The head's monitor and dashboard export metrics on fixed ports by default
        # (44217, 44227): taken by any other Ray head on the machine.
        "AUTOSCALER_METRIC_PORT": str(metric_ports[0]),
        "DASHBOARD_METRIC_PORT": str(metric_ports[1]),
        TAG_ENV: tag})
    env.update(extra or {})
    return env


@contextlib.contextmanager
def _scoped_env(values: dict) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_two_alive(deadline_s: float) -> tuple[str, str]:
    import ray
    deadline = time.monotonic() + deadline_s
    alive: list = []
    while time.monotonic() < deadline:
        alive = [n for n in ray.nodes() if n["Alive"]]
        by_ip = {n["NodeManagerAddress"]: n for n in alive}
        if (HEAD_IP in by_ip and NODE2_IP in by_ip
                and by_ip[NODE2_IP]["Resources"].get(NODE2_RESOURCE)):
            return by_ip[HEAD_IP]["NodeID"], by_ip[NODE2_IP]["NodeID"]
        time.sleep(0.2)
    raise TimeoutError(f"two nodes not alive after {deadline_s}s; alive: "
                       f"{[(n['NodeManagerAddress'], n['NodeID']) for n in alive]}")


@contextlib.contextmanager
def two_node_cluster(num_cpus: int = 1, object_store_memory: int = 100 * _MiB,
                     start_timeout: float = 120.0, env: dict | None = None,
                     include_dashboard: bool = False) -> Iterator[TwoNodeCluster]:
    """Start the head (127.0.0.1) and node 2 (127.0.0.2, ``{"node2": 1}``), connect the driver.

    ``env`` adds variables to both nodes (e.g. ``RAY_<config>`` overrides);
    ``include_dashboard`` starts the head's full dashboard (``dashboard_url``), which the
    state API (``ray.util.state``) and ``ray job submit`` need. Teardown, also
    after a failed start: ``ray.shutdown()``, SIGTERM then SIGKILL to each node's session,
    SIGKILL to any straggler (our tag, or files open under the temp dir), temp dir removed.
    """
    import ray
    if ray.is_initialized():
        raise RuntimeError("two_node_cluster: this process is already connected to Ray")
    if ray._private.ray_constants.ENABLE_RAY_CLUSTER:
        # Read once, when ray is imported: with it, ray.init would turn 127.0.0.1 into
        # the external interface address.
        raise RuntimeError(f"two_node_cluster: set {CLUSTER_ENV}=0 before importing ray")
    tag = uuid.uuid4().hex
    # Bound, never listening: a connection to it is refused at once.
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    # Short path: Ray's unix sockets live under it (108-byte limit).
    temp_root = tempfile.mkdtemp(prefix="rr2n_", dir="/tmp")
    logs = {"head": os.path.join(temp_root, "head-start.log"),
            "node2": os.path.join(temp_root, "node2-start.log")}
    sids: list[int] = []
    t0 = time.monotonic()
    try:
        ports = _free_ports(17)
        gcs, client, dash, nm, om, al, ag, me, re, m1, m2 = ports[:11]
        node_env = _node_env(tag, closed.getsockname()[1], [m1, m2], env)
        head_sid = _start_node(
            [*_ray_cli(), "start", "--head", "--node-ip-address", HEAD_IP, "--port", str(gcs),
             "--temp-dir", os.path.join(temp_root, "h"), "--num-cpus", str(num_cpus),
             "--object-store-memory", str(object_store_memory),
             "--node-manager-port", str(nm), "--object-manager-port", str(om),
             "--min-worker-port", "0", "--max-worker-port", "0",
             "--ray-client-server-port", str(client),
             "--include-dashboard", str(include_dashboard).lower(),
             "--dashboard-host", HEAD_IP, "--dashboard-port", str(dash),
             "--dashboard-agent-listen-port", str(al), "--dashboard-agent-grpc-port", str(ag),
             "--metrics-export-port", str(me), "--runtime-env-agent-port", str(re),
             "--disable-usage-stats"],
            node_env, logs["head"], start_timeout)
        sids.append(head_sid)
        address = f"{HEAD_IP}:{gcs}"
        nm, om, al, ag, me, re = ports[11:]
        spec = dict(gcs_address=address, node_ip_address=NODE2_IP, node_name=NODE2_IP,
                    temp_dir=os.path.join(temp_root, "n"), num_cpus=num_cpus,
                    resources={NODE2_RESOURCE: 1}, object_store_memory=object_store_memory,
                    node_manager_port=nm, object_manager_port=om,
                    min_worker_port=0, max_worker_port=0,
                    dashboard_agent_listen_port=al, metrics_agent_port=ag,
                    metrics_export_port=me, runtime_env_agent_port=re)
        node2_sid = _start_node([sys.executable, os.path.abspath(__file__), "--worker-node",
                                 json.dumps(spec)], node_env, logs["node2"], start_timeout)
        sids.append(node2_sid)
        with _scoped_env({CLUSTER_ENV: "0", "RAY_AUTH_MODE": "disabled"}):
            ray.init(address=address, _node_ip_address=HEAD_IP, log_to_driver=False)
        head_id, node2_id = _wait_two_alive(start_timeout)
        yield TwoNodeCluster(address=address, head_ip=HEAD_IP, node2_ip=NODE2_IP,
                             head_node_id=head_id, node2_node_id=node2_id,
                             node2_resource=NODE2_RESOURCE, temp_root=temp_root,
                             startup_s=time.monotonic() - t0, head_sid=head_sid,
                             node2_sid=node2_sid, tag=tag,
                             dashboard_url=f"http://{HEAD_IP}:{dash}", logs=logs)
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        try:
            # gcs_server takes >3 s to honour SIGTERM; nothing here needs a clean exit.
            for sid in reversed(sids):
                _kill_session(sid, signal.SIGTERM, 3)
            for pid in _stragglers(tag, temp_root):  # left its session: none seen so far
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            closed.close()
            shutil.rmtree(temp_root, ignore_errors=True)


def _start_worker_node(spec: dict) -> None:
    """What ``ray start --address`` does once past its checks: start a non-head node's
    processes (raylet, agents, log monitor), left running when this process exits."""
    import ray._private.node
    import ray._private.parameter
    ray_constants = ray._private.ray_constants
    assert not ray_constants.ENABLE_RAY_CLUSTER, f"run with {CLUSTER_ENV}=0"
    params = ray._private.parameter.RayParams(**spec)
    node = ray._private.node.Node(params, head=False, shutdown_at_exit=False,
                                  spawn_reaper=False)
    print(f"node {node.node_id} on {node.node_ip_address} joined {spec['gcs_address']}",
          flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--worker-node"] or len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} --worker-node JSON_RAY_PARAMS")
    _start_worker_node(json.loads(sys.argv[2]))
