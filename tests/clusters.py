"""A cluster file for the planner's tests: two hosts of four devices, gloo between them."""

from jaxspeed.config.cluster import Cluster, save_cluster


def two_hosts(tmp_path, inter_gbps: float = 0.01):
    """Writes the cluster (its inter-host link at `inter_gbps`, 800 us) under `tmp_path`;
    returns the file's path."""
    cluster = Cluster(
        name="two_hosts", hosts=2, devices_per_host=4, device_memory="8GiB",
        peak_tflops={"bf16": 1.0, "fp32": 1.0}, memory_bandwidth_gbps=10.0,
        intra_host={"bandwidth_gbps": 10.0, "latency_us": 10.0},
        inter_host={"bandwidth_gbps": inter_gbps, "latency_us": 800.0},
        host_link={"bandwidth_gbps": 5.0}, host_memory="16GiB", collectives="gloo")
    return save_cluster(cluster, tmp_path / f"two_hosts_{inter_gbps}.yaml")
