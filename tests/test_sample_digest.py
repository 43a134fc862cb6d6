"""The digest of the samples a run trained on: the same for any split of the rows over
processes, different for other rows, another row order or another step order."""

import numpy as np

from jaxspeed.data.sample_digest import START, batch_fingerprint, chained
from jaxspeed.train.processes import SampleOrder


def global_batch(seed: int, rows: int = 8) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(0, 256, size=(rows, 17), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def rows(batch, start: int, stop: int) -> dict[str, np.ndarray]:
    return {k: v[start:stop] for k, v in batch.items()}


def test_the_processes_shares_add_up_to_the_global_fingerprint():
    batch = global_batch(0)
    whole = batch_fingerprint(batch, first_row=0)
    for processes in (2, 4, 8):
        local = 8 // processes
        shares = [batch_fingerprint(rows(batch, p * local, (p + 1) * local), first_row=p * local)
                  for p in range(processes)]
        assert sum(shares) % 2**64 == whole


def test_other_rows_or_another_row_order_change_the_fingerprint():
    batch = global_batch(0)
    whole = batch_fingerprint(batch, first_row=0)
    swapped = {k: v[[1, 0, *range(2, 8)]] for k, v in batch.items()}
    assert batch_fingerprint(swapped, first_row=0) != whole
    assert batch_fingerprint(global_batch(1), first_row=0) != whole
    one_token = {k: v.copy() for k, v in batch.items()}
    one_token["targets"][3, 5] += 1
    assert batch_fingerprint(one_token, first_row=0) != whole


def test_the_digest_chains_steps_in_order_and_continues_from_a_saved_one():
    a, b = batch_fingerprint(global_batch(0), first_row=0), batch_fingerprint(global_batch(1), first_row=0)
    assert chained(chained(START, 1, a), 2, b) != chained(chained(START, 1, b), 2, a)
    order = SampleOrder(None, step=0, first_row=0)
    order.add(global_batch(0))
    saved = order.digest()
    assert saved == chained(START, 1, a) and len(saved) == 16
    order.add(global_batch(1))
    resumed = SampleOrder(saved, step=1, first_row=0)
    resumed.add(global_batch(1))
    assert resumed.digest() == order.digest() == chained(saved, 2, b)
