"""`jaxspeed.runtime.rendezvous`: the start-up barrier that names who never came, on threads of
this process (the SLURM runs of tests/test_slurm.py use it across network namespaces)."""

import io
import socket
import threading

import pytest

from jaxspeed.errors import JaxspeedError
from jaxspeed.runtime import rendezvous as rv


def free_address() -> str:
    with socket.socket() as s:  # a free port for the barrier
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_ranks(address, count, ranks, timeout, monkeypatch):
    """Runs `ranks` of `count` at once; their exceptions (None: came through) and output."""
    monkeypatch.setattr(rv, "REPORT_SECONDS", 0.5)
    outcome, outs = {}, {r: io.StringIO() for r in ranks}

    def one(rank):
        try:
            rv.rendezvous(address, count, rank, timeout, out=outs[rank])
            outcome[rank] = None
        except JaxspeedError as err:
            outcome[rank] = str(err)

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return outcome, {r: o.getvalue() for r, o in outs.items()}


def test_all_ranks_come_through(monkeypatch):
    outcome, _ = run_ranks(free_address(), 3, [0, 1, 2], 20, monkeypatch)
    assert outcome == {0: None, 1: None, 2: None}


def test_process_zero_names_the_ranks_that_never_came(monkeypatch):
    address = free_address()
    outcome, outs = run_ranks(address, 4, [0, 2], 2, monkeypatch)
    assert outcome[0] == (f"ranks that never came to the coordinator at {address} within 2 s: "
                          "1, 3 (of 4 processes)")
    # rank 2 stops too: told when process 0 gave up, or at its own timeout, whichever first
    assert outcome[2].startswith(f"process 2 of 4: the coordinator at {address} ")
    assert f"process 0 of 4: waiting at {address} for ranks 1, 3 (" in outs[0]


def test_a_rank_without_its_coordinator_says_so_and_stops(monkeypatch):
    address = free_address()
    outcome, outs = run_ranks(address, 2, [1], 2, monkeypatch)
    assert outcome[1] == (f"process 1 of 2: the coordinator at {address} did not let the run "
                          "start within 2 s")
    assert f"process 1 of 2: waiting for the coordinator at {address} (" in outs[1]


def test_one_process_needs_no_barrier():
    rv.rendezvous("nowhere:1", 1, 0, 0.1)


@pytest.mark.parametrize("address", ["nohost", "host:port", ":123"])
def test_a_bad_address_is_one_line(address):
    with pytest.raises(JaxspeedError, match="is not host:port"):
        rv.port_after(address)


@pytest.mark.parametrize("nodelist, first", [
    ("n[1-2]", "n1"), ("node[001,007-015],gpu2", "node001"), ("a,b", "a"), ("solo", "solo")])
def test_the_first_host_of_a_slurm_node_list(nodelist, first):
    assert rv.first_host(nodelist) == first


def test_where_the_barrier_listens():
    assert rv.barrier_address("h:7000", 2, 1, {}) == ("h:7001", 2, 1)  # jaxspeed launch
    slurm = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "4097", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "1"}
    assert rv.barrier_address(None, None, None, slurm) == (f"n1:{57344 + 1}", 2, 1)
    assert rv.barrier_address(None, None, None, {}) is None  # nothing says: JAX's own start-up
