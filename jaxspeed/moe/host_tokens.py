"""The hierarchical exchange that sends a device's tokens across hosts, not its capacity slots.

The 2D all-to-all (`jaxspeed.moe.all_to_all`) sends each other host the slots of that host's
experts in this device's capacity buffer: `E_h * G_l * C` rows (`E_h = E / hosts` experts, `G_l`
groups of capacity `C`), full or empty, and a token routed to two experts of one host twice.
The device has only `N = G_l * Tg` tokens. At top-k with capacity factor `f` over `H` hosts the
slots are `k * f / H` times as many (1.25x at top-2, f = 1.25, 2 hosts), so where `N` is the
smaller (`sends_tokens`) the tokens go across themselves, once, with their routing:

1. across hosts: device `(h, l)` sends its tokens `[N, M]`, each choice's combine weight and
   its slot in the flat buffer to `(h', l)` on every other host (`stack_across_hosts`);
2. each device dispatches the tokens of every host's device of its local index into the slots
   of its own host's experts, `[E_h, H * G_l * C, M]`: the slots the flat exchange fills there;
3. inside the host, the all-to-all to the experts' owners, their FFN and the way back
   (`exchange.through_owners`);
4. each device combines every source's outputs over its host's experts, a partial sum `[N, M]`
   per source, which goes back across hosts to add up with the other hosts' partials
   (`sum_across_hosts`).

So each pair of hosts' link carries `N` rows a device each way instead of `E_h * G_l * C`, in
the same messages (and one of the slots' int32 indices forward). Gradients run the same stages
backwards. The tokens cross in one piece, before any FFN: where collectives overlap compute and
the slots go out in chunks (`a2a_chunks`), the exchange sends the slots, chunk by chunk
(`jaxspeed.moe.exchange`). The result is the flat exchange's, up to the order in which the
combine adds a token's choices.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxspeed.moe.dispatch import combine, dispatch, flat_slots
from jaxspeed.moe.gating import Routing
from jaxspeed.sharding.two_level import host_coordinates, stack_across_hosts, sum_across_hosts


def sends_tokens(*, token_bytes: int, buffer_bytes: int, hosts: int) -> bool:
    """Whether the hierarchical exchange sends the tokens across (this module) rather than the
    slots: a device's tokens `[N, M]` with their routing (`token_bytes`) are fewer bytes than
    its capacity buffer's share for one other host (`buffer_bytes / hosts`)."""
    return hosts > 1 and token_bytes * hosts < buffer_bytes


def exchange_tokens(x, routing: Routing, through_owners, *, groups: int, num_experts: int,
                    axis: str, hosts: int, impl: str = "auto"):
    """The experts' outputs for this device's tokens, combined: `[N, M]`.

    Args:
      x: `[N, M]` this device's tokens, its `G_l` groups one after another.
      routing: their routing over the `G_l * E` virtual experts `g * E + e` (one group's
        experts after another's: `parallel._flat_routing`).
      through_owners: `buf [E_h, S, M] -> [E_h, S, M]`, the host's experts' FFN on their
        slots, run by their owners (the all-to-all inside the host and back).
      groups: `G_l`.
      num_experts: `E`, divisible by `hosts`.
      axis: the manual expert mesh axis, `hosts * per_host` devices host-major.
      hosts: the hosts `axis` spans.
      impl: `dispatch`'s and `combine`'s.
    """
    tokens, width = x.shape
    capacity = routing.capacity
    host_experts = num_experts // hosts
    weight = routing.weight.astype(jnp.float32)
    slot = flat_slots(routing, capacity, groups * num_experts)  # -1 where dropped
    if x.dtype == weight.dtype:  # one message: the tokens and their weights side by side
        both = stack_across_hosts(jnp.concatenate([x, weight], axis=1), axis, hosts=hosts)
        xs, weights = both[..., :width], both[..., width:]
    else:
        xs = stack_across_hosts(x, axis, hosts=hosts)
        weights = stack_across_hosts(weight, axis, hosts=hosts)
    slots = stack_across_hosts(slot, axis, hosts=hosts)  # [H, N, k] from each host

    # The choices of this host's experts, as virtual experts (s * G_l + g) * E_h + e - h * E_h.
    _, host, _ = host_coordinates(axis, hosts)  # this device's host
    virtual, position = slots // capacity, slots % capacity
    group, expert = virtual // num_experts, virtual % num_experts - host * host_experts
    here = (slots >= 0) & (expert >= 0) & (expert < host_experts)
    source = jnp.arange(hosts, dtype=jnp.int32)[:, None, None]
    local = routing._replace(
        expert_index=jnp.where(here, (source * groups + group) * host_experts + expert, -1
                               ).reshape(hosts * tokens, -1),
        position=jnp.where(here, position, capacity).reshape(hosts * tokens, -1),
        weight=weights.reshape(hosts * tokens, -1))

    slots_per = hosts * groups * capacity
    buf = dispatch(xs.reshape(hosts * tokens, width), local, hosts * groups * host_experts,
                   impl=impl)
    buf = buf.reshape(hosts * groups, host_experts, capacity, width).swapaxes(0, 1)
    out = through_owners(buf.reshape(host_experts, slots_per, width))
    out = out.reshape(host_experts, hosts * groups, capacity, width).swapaxes(0, 1)
    partial = combine(out.reshape(hosts * groups * host_experts, capacity, width), local,
                      impl=impl)
    return sum_across_hosts(partial.reshape(hosts, tokens, width), axis, hosts=hosts)
