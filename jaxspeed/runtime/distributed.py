"""Process-level setup: emulated CPU devices and `jax.distributed` for multi-process runs.

Both must run before JAX creates its backend (the first `jax.devices()` call).

`jaxspeed launch` (see `jaxspeed.runtime.launch`) tells each process where it stands through
environment variables; `initialize()` reads them, and without them lets
`jax.distributed.initialize` auto-detect the cluster (SLURM, Open MPI, Kubernetes, TPU pods).
Where there is neither, the process runs alone, so a script that calls `initialize()` runs
unchanged on one machine.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator, Mapping, Sequence

import jax

from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.runtime.rendezvous import barrier_address, rendezvous

ENV_COORDINATOR = "JAXSPEED_COORDINATOR"  # "host:port" of process 0's coordination service
ENV_NUM_PROCESSES = "JAXSPEED_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXSPEED_PROCESS_ID"
ENV_CPU_DEVICES = "JAXSPEED_CPU_DEVICES"  # emulated CPU devices per process (informational)
ENV_INIT_TIMEOUT = "JAXSPEED_INIT_TIMEOUT"  # seconds for the start-up barrier
#: seconds without a heartbeat after which a process counts as dead (hung: SIGSTOP, a lost
#: node), and the others stop
ENV_HEARTBEAT_TIMEOUT = "JAXSPEED_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 300
DEFAULT_INIT_TIMEOUT = 300  # jax.distributed's own default, for clusters
#: what `jax.distributed.initialize` raises (ValueError) when it is given no coordinator and
#: detects no cluster; the same words in jax 0.3 to 0.12 (tests/test_distributed.py checks them)
_NO_CLUSTER = "coordinator_address should be defined"

logger = logging.getLogger(__name__)


def set_cpu_devices(count: int) -> None:
    """Runs on the CPU platform with `count` emulated devices (tests, laptops, CI).

    Raises:
      ConfigError: `count` is not a whole number >= 1 (a `ValueError` too).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"--cpu-devices must be a whole number of devices >= 1, got {count!r}")
    jax.config.update("jax_platforms", "cpu")
    flag = f"--xla_force_host_platform_device_count={count}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, flag])
    jax.config.update("jax_num_cpu_devices", count)


def launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by `jaxspeed launch` (its env names a process count)."""
    environ = os.environ if environ is None else environ
    return bool(environ.get(ENV_NUM_PROCESSES))


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise JaxspeedError(f"environment variable {name}={raw!r} is not an integer") from None


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids=None,
    cpu_collectives: str = "gloo",
    initialization_timeout: int | None = None,
    require_cluster: bool = False,
) -> bool:
    """Starts JAX's distributed runtime; a thin wrapper over `jax.distributed.initialize`.

    Arguments left as None are read from the `JAXSPEED_*` variables that `jaxspeed launch`
    sets (`JAXSPEED_COORDINATOR`, `JAXSPEED_NUM_PROCESSES`, `JAXSPEED_PROCESS_ID`,
    `JAXSPEED_INIT_TIMEOUT`); where those are absent too, JAX auto-detects the cluster
    (SLURM, Open MPI, Kubernetes, TPU pods). Where it finds none either, there is nothing to
    join: the process runs alone, as it would without this call (one process, its own
    devices), and this returns False. On CPU, cross-process collectives use
    `cpu_collectives` (gloo), which JAX needs to be told before the backend starts. Call this
    before any JAX computation.

    Before JAX's own start-up, the processes meet at `jaxspeed.runtime.rendezvous` (with
    `jaxspeed launch`'s variables or under SLURM), which says every few seconds who is still
    waiting, and where.

    Args:
      coordinator_address: "host:port" of process 0.
      num_processes: total number of processes.
      process_id: this process's rank.
      local_device_ids: devices this process drives (default: all visible).
      cpu_collectives: `jax_cpu_collectives_implementation` for CPU runs.
      initialization_timeout: seconds to wait for every process at start-up (default:
        `JAXSPEED_INIT_TIMEOUT`, else 300). After start-up, a process that sends no heartbeat
        for `JAXSPEED_HEARTBEAT_TIMEOUT` seconds (default 300: hung, stopped, its node lost)
        counts as dead, and JAX stops the others.
      require_cluster: with nothing to join, raise instead of running alone (`jaxspeed train
        --distributed`, which asks for a cluster).

    Returns:
      whether JAX's distributed runtime started (False: one process, nothing to join).

    Raises:
      JaxspeedError: when the runtime does not start: process 0 names the ranks that did not
        arrive at the start-up barrier in time, the others the coordinator.
    """
    env = os.environ
    if coordinator_address is None:
        coordinator_address = env.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(env, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(env, ENV_PROCESS_ID)
    if initialization_timeout is None:
        initialization_timeout = _env_int(env, ENV_INIT_TIMEOUT) or DEFAULT_INIT_TIMEOUT
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    barrier = barrier_address(coordinator_address, num_processes, process_id, env)
    if barrier is not None:
        rendezvous(*barrier, initialization_timeout)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=(_env_int(env, ENV_HEARTBEAT_TIMEOUT)
                                       or DEFAULT_HEARTBEAT_TIMEOUT),
        )
    except (RuntimeError, ValueError) as err:
        detected = coordinator_address is None and num_processes is None and process_id is None
        alone = isinstance(err, ValueError) and _NO_CLUSTER in str(err)
        if detected and alone and not require_cluster:
            logger.info("no cluster to join (no JAXSPEED_* variables, none detected): one process")
            return False
        where = (
            f"coordinator {coordinator_address}, process {process_id} of {num_processes}"
            if coordinator_address
            else "cluster auto-detection"
        )
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise JaxspeedError(
            f"jax.distributed.initialize failed ({where}, timeout {initialization_timeout} s): "
            f"{first}"
        ) from err
    return True


#: device → the process it stands for, inside `emulated_processes`
_EMULATED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("emulated", default=None)


@contextlib.contextmanager
def emulated_processes(count: int, devices: Sequence) -> Iterator[None]:
    """Inside, `devices` count as split over `count` processes: contiguous blocks in device-id
    order, as `jax.distributed` numbers the devices of `count` processes with as many each.

    `plan --cluster` compiles a cluster's step on one process. Where the cluster's hosts split
    `data`, `mesh.hosts` gives the mesh a `host` axis; where they split another axis (the slow
    link's `mesh.expert=4, mesh.data=1`), a real run knows its hosts only from its devices'
    processes, and so, inside this, does the compiled step (`process_of`, `process_total`).
    """
    ordered = sorted(devices, key=lambda d: d.id)
    if count < 1 or len(ordered) % count:
        raise ConfigError(f"{len(ordered)} devices do not split into {count} processes")
    per = len(ordered) // count
    token = _EMULATED.set({d: i // per for i, d in enumerate(ordered)})
    try:
        yield
    finally:
        _EMULATED.reset(token)


def process_of(device) -> int:
    """The process `device` belongs to (the emulated one inside `emulated_processes`)."""
    emulated = _EMULATED.get()
    return device.process_index if emulated is None else emulated.get(device, device.process_index)


def process_total() -> int:
    """`jax.process_count()`, or the emulated count inside `emulated_processes`."""
    emulated = _EMULATED.get()
    return jax.process_count() if emulated is None else max(emulated.values()) + 1


def process_count(devices) -> int:
    """The processes `devices` belong to."""
    return len({process_of(d) for d in devices})


def over_gloo(devices) -> bool:
    """Whether collectives among `devices` run over gloo: CPU devices of several processes
    (XLA:CPU's collectives between processes; `initialize`'s `cpu_collectives`)."""
    devices = list(devices)
    return devices[0].platform == "cpu" and process_count(devices) > 1
