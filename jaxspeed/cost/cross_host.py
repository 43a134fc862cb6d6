"""What a compiled step sends between hosts: the bytes of the collectives whose device groups
span hosts, and the messages of the point-to-point ones (what `plan` prints under "across
hosts")."""

from __future__ import annotations

from collections.abc import Sequence

from jaxspeed.cost.hlo import COLLECTIVES, collectives


def cross_host_bytes(
    hlo_text: str, *, num_devices: int, host_of: Sequence[int]
) -> dict[str, int]:
    """`collective_bytes` of the collectives whose device groups span more than one host.

    Args:
      hlo_text: `compiled.as_text()` of a jitted step.
      num_devices: devices of the program.
      host_of: the host of each partition id (the program's devices in mesh order).

    Returns:
      `{kind: bytes}` per device and run, plus `total`: what those collectives move; on a ring
      only part of it crosses the link, so it bounds the link's bytes from above.
    """
    totals = dict.fromkeys(COLLECTIVES, 0)
    for op in collectives(hlo_text, num_devices=num_devices):
        if any(len({host_of[d] for d in group}) > 1 for group in op.groups or ()):
            totals[op.kind] += op.bytes * op.executions
    totals["total"] = sum(totals[k] for k in COLLECTIVES)
    return totals


def cross_host_messages(
    hlo_text: str, *, num_devices: int, host_of: Sequence[int]
) -> dict[str, int]:
    """Messages the busiest device sends to other hosts per run, by the point-to-point kinds
    whose message count is the program's own: `all-to-all` (one to each member of its group on
    another host) and `collective-permute` (one where its target is on another host). Rings
    (all-gather, reduce-scatter, all-reduce) are the library's choice and are not counted.

    Args and hosts as for `cross_host_bytes`. Returns `{"all-to-all": n,
    "collective-permute": n}`.
    """
    counts = {"all-to-all": 0, "collective-permute": 0}
    for op in collectives(hlo_text, num_devices=num_devices):
        if op.kind not in counts or not op.groups:
            continue
        if op.kind == "collective-permute":
            sent = max((host_of[a] != host_of[b] for a, b in op.groups), default=False)
        else:
            sent = max(sum(host_of[m] != host_of[d] for m in group)
                       for group in op.groups for d in group)
        counts[op.kind] += int(sent) * op.executions
    return counts
