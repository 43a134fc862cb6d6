"""`plan --cluster` on one process stands for the cluster's processes where its hosts split an
axis other than `data` (the slow link's MoE mesh: the expert axis spans the hosts), so the
compiled step and its "across hosts" profile are those of the real run."""

import json

import jax
import pytest

from jaxspeed.cli import main
from jaxspeed.errors import ConfigError
from jaxspeed.runtime.distributed import (
    emulated_processes, process_count, process_of, process_total)
from jaxspeed.runtime.mesh import host_of_devices, make_mesh
from jaxspeed.sharding.two_level import spanned_hosts
from clusters import two_hosts

#: the MoE GPT, small: one MoE layer of 8 experts, top-2
SMALL_MOE = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
             "model.moe.d_ff=32", "model.max_seq_len=32", "data.seq_len=32",
             "train_micro_batch_size_per_device=1", "mesh.data=1", "mesh.expert=8"]


def test_devices_stand_for_processes_in_blocks_and_only_inside():
    devices = jax.devices()
    assert process_total() == 1 and process_count(devices) == 1
    with emulated_processes(2, devices[::-1]):  # blocks by device id, whatever the order given
        assert [process_of(d) for d in devices] == [0] * 4 + [1] * 4
        assert process_total() == 2 and process_count(devices[2:6]) == 2
        mesh = make_mesh({"data": 1, "expert": 8})
        assert host_of_devices(mesh) == [0] * 4 + [1] * 4
        assert spanned_hosts(mesh, "expert") == 2
        two_data = make_mesh({"data": 2, "expert": 4})  # hosts: auto splits data, as 2 processes do
        assert two_data.shape["host"] == 2 and spanned_hosts(two_data, "expert") == 1
    assert process_total() == 1 and host_of_devices(make_mesh({"expert": 8})) == [0] * 8
    with pytest.raises(ConfigError, match="8 devices do not split into 3 processes"):
        with emulated_processes(3, devices):
            pass


def test_plan_counts_what_the_expert_axis_sends_across_the_clusters_hosts(tmp_path, capsys):
    """The flat exchange sends an all-to-all's 4 messages across per device; the hierarchical
    one none (its `ppermute`s cross instead, one a stage), and fewer messages across in all.
    (One host sends nothing across: tests/test_cross_host_bytes.py.)"""
    cluster = str(two_hosts(tmp_path))

    def profile(*options):
        sets = [a for s in [*SMALL_MOE, *options] for a in ("--set", s)]
        assert main(["plan", "configs/gpt_moe.yaml", "--json",
                     *cluster, *sets]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]

    cluster = ["--cluster", cluster]
    flat = profile()
    hierarchical = profile("model.moe.all_to_all=hierarchical")
    assert flat["cross_host_messages"]["all-to-all"] > 0
    assert flat["cross_host_bytes"]["all-to-all"] > 0
    assert hierarchical["cross_host_messages"]["all-to-all"] == 0
    assert hierarchical["cross_host_bytes"]["all-to-all"] == 0
    assert hierarchical["cross_host_messages"]["collective-permute"] > 0
    assert (sum(hierarchical["cross_host_messages"].values())
            < sum(flat["cross_host_messages"].values()))
