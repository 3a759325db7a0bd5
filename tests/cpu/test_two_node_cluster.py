"""A real two-node Ray cluster on loopback (tests/two_node.py): scheduling by node,
STRICT_SPREAD placement groups, and the loss of a node.

The tests share one module-scoped cluster and run in file order: the last one kills
node 2.
"""
import time

import pytest
import ray
from ray.util.placement_group import (
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from two_node import NODE2_IP, two_node_cluster

pytestmark = pytest.mark.slow

NODE_DEATH_DEADLINE_S = 60.0
# The GCS declares a node dead after health_check_failure_threshold (5) missed checks,
# one every health_check_period_ms (3000 by default: 15 s); 1 s keeps the test short.
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000"}


@pytest.fixture(scope="module")
def cluster():
    with two_node_cluster(env=HEALTH_CHECK) as c:
        yield c


@ray.remote(num_cpus=0)
def where():
    return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0)
def nbytes(blob):
    return ray.util.get_node_ip_address(), len(blob)


@ray.remote(num_cpus=0)
class Probe:
    def where(self):
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


def test_two_nodes_alive_on_distinct_loopback_ips(cluster):
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert set(alive) == {cluster.head_node_id, cluster.node2_node_id}
    head, node2 = alive[cluster.head_node_id], alive[cluster.node2_node_id]
    assert head["NodeManagerAddress"] == cluster.head_ip == "127.0.0.1"
    assert node2["NodeManagerAddress"] == cluster.node2_ip == NODE2_IP
    assert node2["Resources"].get(cluster.node2_resource) == 1
    assert cluster.node2_resource not in head["Resources"]
    # The driver is attached to the head, and sees itself there.
    assert ray.get_runtime_context().get_node_id() == cluster.head_node_id
    assert ray.util.get_node_ip_address() == cluster.head_ip
    print(f"two-node cluster up in {cluster.startup_s:.1f}s")


def test_task_and_actor_run_on_node2(cluster):
    res = {cluster.node2_resource: 0.01}
    ip, node_id = ray.get(where.options(resources=res).remote(), timeout=60)
    assert (ip, node_id) == (cluster.node2_ip, cluster.node2_node_id)
    assert ip != cluster.head_ip
    # A task without the resource can land anywhere; one pinned by node affinity on the head.
    head_ip, head_id = ray.get(where.options(
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
            cluster.head_node_id, soft=False)).remote(), timeout=60)
    assert (head_ip, head_id) == (cluster.head_ip, cluster.head_node_id)

    actor = Probe.options(resources={cluster.node2_resource: 1}).remote()
    try:
        assert ray.get(actor.where.remote(), timeout=60) == (cluster.node2_ip,
                                                              cluster.node2_node_id)
    finally:
        ray.kill(actor)
    # An object put by the driver (head's object store) is pulled by node 2.
    blob = ray.put(b"x" * (4 * 1024 * 1024))
    assert ray.get(nbytes.options(resources=res).remote(blob), timeout=60) == (
        cluster.node2_ip, 4 * 1024 * 1024)


def test_strict_spread_placement_group_uses_both_nodes(cluster):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_SPREAD")
    try:
        ray.get(pg.ready(), timeout=60)
        bundle_nodes = placement_group_table(pg)["bundles_to_node_id"]
        assert sorted(bundle_nodes.values()) == sorted(
            [cluster.head_node_id, cluster.node2_node_id])
        placed = ray.get([
            where.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=i)).remote()
            for i in range(2)], timeout=60)
        assert {ip for ip, _ in placed} == {cluster.head_ip, cluster.node2_ip}
        assert [node_id for _, node_id in placed] == [bundle_nodes[0], bundle_nodes[1]]
    finally:
        remove_placement_group(pg)
    # Three bundles cannot be strictly spread over two nodes: the group stays pending.
    pg3 = placement_group([{"CPU": 0.1}] * 3, strategy="STRICT_SPREAD")
    try:
        ready, _ = ray.wait([pg3.ready()], timeout=3)
        assert not ready
    finally:
        remove_placement_group(pg3)


def test_node2_death_is_seen_and_head_keeps_working(cluster):
    """Destructive: kills node 2 (the last test of the module)."""
    actor = Probe.options(resources={cluster.node2_resource: 1}, max_restarts=0).remote()
    assert ray.get(actor.where.remote(), timeout=60)[0] == cluster.node2_ip

    t0 = time.monotonic()
    cluster.kill_node2()
    deadline = t0 + NODE_DEATH_DEADLINE_S
    while (node := cluster.node(cluster.node2_node_id)) is not None and node["Alive"]:
        assert time.monotonic() < deadline, f"node 2 still alive after {NODE_DEATH_DEADLINE_S}s"
        time.sleep(0.2)
    print(f"node 2 seen dead {time.monotonic() - t0:.1f}s after the kill")

    head = cluster.node(cluster.head_node_id)
    assert head is not None and head["Alive"]
    assert ray.get([where.remote() for _ in range(4)], timeout=60) == [
        (cluster.head_ip, cluster.head_node_id)] * 4
    assert ray.get(nbytes.remote(ray.put(b"y" * 1024)), timeout=60) == (cluster.head_ip, 1024)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.where.remote(), timeout=60)
    assert cluster.node2_resource not in ray.available_resources()
