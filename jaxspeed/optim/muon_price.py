"""Where Muon's Newton–Schulz is cheaper: each matrix whole on an owner, or where it is split.

Matrices `[m, n]` split over `k` devices (ZeRO, tensor parallelism) can iterate two ways
(`jaxspeed.optim.muon`):
- `owner`: an all-to-all moves them whole onto the `k` devices, a share each, and back. The
  stack is padded to a multiple of `k`, so a device iterates on `ceil(count / k)` matrices.
- `sharded`: every device iterates on its `1/k` of every matrix, and XLA partitions the
  matmuls: each step all-reduces the partial Gram matrix `X Xᵀ` (`[m, m]`, `m` the smaller
  side) once, and the other products are local.

`Rates` prices both: the iteration's FLOPs at a device's matmul rate, the bytes each device
sends at its link's bandwidth (a ring's `(k - 1) / k` of the buffer, twice for an all-reduce),
no overlap. Without rates, the rule is `owner` unless the padding is over half the work.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxspeed.config.cluster import load_cluster
from jaxspeed.errors import ConfigError


class Rates(NamedTuple):
    """What one device's Newton–Schulz runs at.

    Attributes:
      flops: FLOP/s of the iteration's matmuls.
      intra_host: bytes/s one device sends to others of its host, every device sending.
      inter_host: the same across hosts (the owners span hosts when `host` splits them).
    """

    flops: float
    intra_host: float
    inter_host: float


def rates_of(cluster: Any) -> Rates:
    """The `Rates` of a `jaxspeed.config.cluster.Cluster`: its matmul peak at its efficiency,
    in the iteration's dtype (bf16 on a GPU cluster, float32 elsewhere), and its links."""
    dtype = "bf16" if cluster.gpu else "float32"
    return Rates(cluster.peak_flops(dtype) * cluster.efficiency,
                 cluster.intra_host.bandwidth_gbps * 1e9, cluster.inter_host.bandwidth_gbps * 1e9)


def cluster_rates(cluster: str | None) -> Rates | None:
    """The `Rates` of the cluster preset or file `optimizer.params.cluster` names (None: none),
    which price `placement: auto` in the engine and the planner alike."""
    if cluster is None:
        return None
    try:
        return rates_of(load_cluster(cluster))
    except ConfigError as err:
        raise ConfigError(f"optimizer.params.cluster: {err}") from None


def newton_schulz_flops(fan_in: int, fan_out: int, steps: int = 5) -> int:
    """FLOPs of `newton_schulz` on one matrix: per step `X Xᵀ`, its square and the product
    with `X`, on the wide orientation (`m <= n`): `4 m² n + 2 m³`."""
    m, n = sorted((fan_in, fan_out))
    return steps * (4 * m * m * n + 2 * m**3)


def seconds(placement: str, fans: tuple[int, int], *, count: int, padded: int, owners: int,
            steps: int, flops: float, bandwidth: float) -> float:
    """One device's time for `count` matrices of shape `fans` split over `owners` devices
    (`padded`: the stack padded to a multiple of them), at `placement` `owner` or `sharded`."""
    one, ring = newton_schulz_flops(*fans, steps), (owners - 1) / owners
    if placement == "owner":
        share = padded // owners
        return share * one / flops + 2 * 4 * share * fans[0] * fans[1] * ring / bandwidth
    gram = 4 * min(fans) ** 2
    return count * one / owners / flops + steps * count * 2 * gram * ring / bandwidth


def owner_is_cheaper(fans: tuple[int, int], *, count: int, padded: int, owners: int,
                     steps: int, rates: Rates | None, across_hosts: bool = False) -> bool:
    """Whether `owner` is the cheaper placement of `count` matrices (`seconds`), at `rates`
    (the inter-host link's when `across_hosts`); None: unless padding doubles the stack."""
    if rates is None:
        return padded <= 2 * count
    price = dict(count=count, padded=padded, owners=owners, steps=steps, flops=rates.flops,
                 bandwidth=rates.inter_host if across_hosts else rates.intra_host)
    return seconds("owner", fans, **price) <= seconds("sharded", fans, **price)
