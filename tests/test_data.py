"""Tests for byte-level token data (jaxspeed/data/dataset.py) and the LM loss (jaxspeed/ops/losses.py)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspeed.data import TokenDataset, load_text_bytes, make_global_batch
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.ops.losses import lm_loss
from numerics import program_rtol

SMALL = 200_000


@pytest.fixture(scope="module")
def corpus():
    return load_text_bytes(max_bytes=SMALL)


def test_stdlib_source_loads_megabytes_by_default():
    data = load_text_bytes()
    assert data.dtype == np.uint8
    assert data.size > 1_000_000
    assert b"def " in data[:SMALL].tobytes()


def test_stdlib_is_deterministic_and_capped(corpus):
    assert corpus.size == SMALL
    np.testing.assert_array_equal(corpus, load_text_bytes(max_bytes=SMALL))


def test_batch_shapes_and_shift(corpus):
    ds = TokenDataset(corpus, seq_len=32, seed=3)
    assert ds.vocab_size == 256
    batch = ds.batch(0, global_batch=4)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 32)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_rows_are_windows_of_the_corpus():
    tokens = np.arange(1000) % 251  # a window is determined by its first value (period 251)
    ds = TokenDataset(tokens.astype(np.uint8), seq_len=32, eval_fraction=0.1, seed=0)
    batch = ds.batch(5, global_batch=8)
    for inputs, targets in zip(batch["inputs"], batch["targets"]):
        start = int(np.flatnonzero(tokens[:900] == inputs[0])[0])
        np.testing.assert_array_equal(inputs, tokens[start : start + 32])
        np.testing.assert_array_equal(targets, tokens[start + 1 : start + 33])


def test_batches_are_deterministic_by_step(corpus):
    ds = TokenDataset(corpus, seq_len=16, seed=1)
    again = TokenDataset(corpus, seq_len=16, seed=1)
    for step in (0, 7, 1234):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(
                ds.batch(step, global_batch=8)[key], again.batch(step, global_batch=8)[key]
            )
    assert not np.array_equal(ds.batch(0, global_batch=8)["inputs"], ds.batch(1, global_batch=8)["inputs"])
    other_seed = TokenDataset(corpus, seq_len=16, seed=2)
    assert not np.array_equal(
        ds.batch(0, global_batch=8)["inputs"], other_seed.batch(0, global_batch=8)["inputs"]
    )


@pytest.mark.parametrize("split", ["train", "eval"])
def test_process_slices_concatenate_to_the_global_batch(corpus, split):
    ds = TokenDataset(corpus, seq_len=16, seed=0)
    whole = ds.batch(3, global_batch=8, split=split)
    parts = [ds.batch(3, global_batch=8, split=split, process_index=i, process_count=2) for i in range(2)]
    for key in ("inputs", "targets"):
        assert parts[0][key].shape == (4, 16)
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_process_count_must_divide_global_batch(corpus):
    ds = TokenDataset(corpus, seq_len=16)
    with pytest.raises(ValueError, match="divisible"):
        ds.batch(0, global_batch=6, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        ds.batch(0, global_batch=8, process_index=2, process_count=2)
    with pytest.raises(ValueError, match="accepted"):
        ds.batch(0, global_batch=8, split="test")


def test_eval_split_is_held_out():
    tokens = np.arange(2000) % 256  # train = 0..1899, eval = 1900..1999 positions
    ds = TokenDataset(tokens.astype(np.uint8), seq_len=8, eval_fraction=0.05, seed=0)
    assert ds.num_tokens("train") == 1900 and ds.num_tokens("eval") == 100
    eval_rows = np.concatenate([ds.batch(s, global_batch=16, split="eval")["targets"] for s in range(5)])
    # Eval bytes come from positions ≥ 1900, i.e. values (1900..1999) % 256 = 108..207.
    assert eval_rows.min() >= 108 and eval_rows.max() <= 207
    train = ds.batch(0, global_batch=4, split="train")
    eval_ = ds.batch(0, global_batch=4, split="eval")
    assert not np.array_equal(train["inputs"], eval_["inputs"])


def test_split_too_short_is_an_error():
    with pytest.raises(ConfigError, match="eval split has"):
        TokenDataset(np.zeros(100, np.uint8), seq_len=16, eval_fraction=0.1)
    with pytest.raises(ConfigError, match="seq_len"):
        TokenDataset(np.zeros(10, np.uint8), seq_len=16, eval_fraction=0.0)


def test_path_source_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"hello world\n" * 10)
    data = load_text_bytes(source="path", path=str(path))
    assert data.tobytes() == b"hello world\n" * 10
    assert load_text_bytes(source="path", path=str(path), max_bytes=5).tobytes() == b"hello"


def test_path_source_folder(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"second")
    (tmp_path / "a.txt").write_bytes(b"first")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01binary")
    data = load_text_bytes(source="path", path=str(tmp_path))
    assert data.tobytes() == b"first\nsecond"


def test_from_config_with_path(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(range(32, 127)) * 20)
    cfg = SimpleNamespace(source="path", path=str(path), seq_len=8, eval_fraction=0.1, max_bytes=None)
    ds = TokenDataset.from_config(cfg, seed=4)
    assert ds.batch(0, global_batch=2)["inputs"].shape == (2, 8)
    assert ds.num_tokens("train") + ds.num_tokens("eval") == 95 * 20


def test_missing_or_empty_path_is_an_error(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(JaxspeedError, match="nope.txt"):
        load_text_bytes(source="path", path=str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(JaxspeedError, match="empty"):
        load_text_bytes(source="path", path=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="stdlib"):
        load_text_bytes(source="web")


def test_make_global_batch_single_process(corpus):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.P("data"))
    ds = TokenDataset(corpus, seq_len=16)
    local = ds.batch(0, global_batch=16, process_index=jax.process_index(), process_count=jax.process_count())
    batch = make_global_batch(local, sharding, 16)
    assert batch["inputs"].shape == (16, 16)
    assert batch["inputs"].sharding == sharding
    np.testing.assert_array_equal(np.asarray(batch["targets"]), local["targets"])


#: lm_loss in fp32 against float64 (tests/numerics.py): a log-softmax over 7 logits (its max,
#: its sum of exponentials) and the (masked) mean over 2 x 5 tokens.
LOSS_RTOL = program_rtol(width=10, depth=3)


def _numpy_cross_entropy(logits, targets):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return -np.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def test_lm_loss_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    loss = lm_loss(jnp.asarray(logits), {"targets": targets})
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, _numpy_cross_entropy(logits, targets).mean(), rtol=LOSS_RTOL)


def test_lm_loss_with_mask():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    targets = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]], np.float32)
    per_token = _numpy_cross_entropy(logits, targets)
    expected = (per_token * mask).sum() / mask.sum()
    loss32 = lm_loss(jnp.asarray(logits), {"targets": targets, "mask": mask.astype(bool)})
    np.testing.assert_allclose(loss32, expected, rtol=LOSS_RTOL)
    # bf16 logits: the loss is still computed in fp32, so it matches the float64 loss of the
    # bf16-rounded logits to the fp32 tolerance (one computed in bf16 is 4e-4 off here).
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    loss = lm_loss(bf16, {"targets": targets, "mask": mask})
    assert loss.dtype == jnp.float32
    rounded = _numpy_cross_entropy(np.asarray(bf16, np.float32), targets)
    np.testing.assert_allclose(loss, (rounded * mask).sum() / mask.sum(), rtol=LOSS_RTOL)
    zero = lm_loss(jnp.asarray(logits), {"targets": targets, "mask": np.zeros_like(mask)})
    assert float(zero) == 0.0
