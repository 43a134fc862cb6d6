"""Params checkpoints (`.npy` per array, written block by block) and the HF conversion's copies."""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxspeed.checkpoint import CheckpointError
from jaxspeed.checkpoint.hf.weights import _READ, _copy_into
from jaxspeed.runtime.mesh import make_mesh
from jaxspeed.checkpoint.params import (
    ARRAYS, RECORD, open_params, read_record, restore_params, save_params, saved_shapes, write_params,
)

MODEL = {"d_model": 8}


def params_tree(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {"embedding": rng.standard_normal((16, 8)).astype(dtype),
            "layers": {"attn": {"query": rng.standard_normal((2, 8, 4, 2)).astype(dtype)}},
            "final_norm": {"scale": rng.standard_normal(8).astype(dtype)}}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip_keeps_values_and_dtype(tmp_path, dtype):
    params = params_tree(dtype)
    save_params(tmp_path / "ckpt", params, model=MODEL, extra={"source": "test"})
    record = read_record(tmp_path / "ckpt")
    assert record["source"] == "test" and record["dtype"] == np.dtype(dtype).name
    assert record["arrays"]["layers.attn.query"] == {"shape": [2, 8, 4, 2], "dtype": np.dtype(dtype).name}
    assert sorted(p.name for p in (tmp_path / "ckpt" / ARRAYS).iterdir()) == [
        "embedding.npy", "final_norm.scale.npy", "layers.attn.query.npy"]
    shapes = saved_shapes(tmp_path / "ckpt")
    assert shapes["layers"]["attn"]["query"] == jax.ShapeDtypeStruct((2, 8, 4, 2), np.dtype(dtype))
    back = restore_params(tmp_path / "ckpt", shapes)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8)), back, params)
    assert all(x.dtype == np.dtype(dtype) for x in jax.tree.leaves(back))


def test_writing_leaves_another_writers_tmp_folder_and_nothing_on_failure(tmp_path):
    theirs = tmp_path / "ckpt.tmp"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("mine")
    save_params(tmp_path / "ckpt", params_tree(), model=MODEL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.tmp"]
    assert (theirs / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError):  # a fill that fails half way
        write_params(tmp_path / "bad", {"x": jax.ShapeDtypeStruct((2,), np.float32)},
                     {"x": [lambda out: (_ for _ in ()).throw(ValueError("disk"))]}, model=MODEL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.tmp"]


def test_restore_reads_each_device_slice_into_the_sharding(tmp_path):
    params = params_tree()
    save_params(tmp_path / "ckpt", params, model=MODEL)
    mesh = make_mesh({"data": 4, "tensor": 2})
    specs = {"embedding": P("data", "tensor"), "layers": {"attn": {"query": P(None, "data", "tensor")}},
             "final_norm": {"scale": P()}}
    target = jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, np.float32, sharding=NamedSharding(mesh, spec)),
        params, specs, is_leaf=lambda x: isinstance(x, P) or hasattr(x, "shape"),
    )
    back = restore_params(tmp_path / "ckpt", target)
    for got, want, spec in zip(jax.tree.leaves(back), jax.tree.leaves(params),
                               jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        assert got.sharding.spec == spec
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])


def test_restore_casts_to_the_target_dtype(tmp_path):
    params = params_tree()
    save_params(tmp_path / "ckpt", params, model=MODEL)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, ml_dtypes.bfloat16), params)
    back = restore_params(tmp_path / "ckpt", target)
    np.testing.assert_array_equal(back["embedding"], params["embedding"].astype(ml_dtypes.bfloat16))


def test_a_failed_write_leaves_nothing(tmp_path):
    params = params_tree()
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    names = [".".join(path) for path in traverse_util.flatten_dict(params)]

    def stop(out):
        raise RuntimeError("stop")

    blocks = {name: [lambda out: out.fill(0)] for name in names}
    blocks[names[-1]] = [stop]  # after the other arrays are on disk
    with pytest.raises(RuntimeError, match="stop"):
        write_params(tmp_path / "ckpt", shapes, blocks, model=MODEL)
    assert list(tmp_path.iterdir()) == []


def test_arrays_are_written_block_by_block(tmp_path):
    """A stacked array from one fill per leading block, bit for bit; a bad split is refused."""
    x = np.random.default_rng(0).standard_normal((4, 3, 5)).astype(ml_dtypes.bfloat16)
    shapes = {"w": jax.ShapeDtypeStruct(x.shape, x.dtype)}
    fills = [lambda out, i=i: out.__setitem__(Ellipsis, x[i]) for i in range(4)]
    write_params(tmp_path / "ckpt", shapes, {"w": fills}, model=MODEL)
    np.testing.assert_array_equal(open_params(tmp_path / "ckpt")["w"], x)
    with pytest.raises(ValueError, match=r"3 blocks; shape \(4, 3, 5\) takes 1 or \(4,\)"):
        write_params(tmp_path / "bad", shapes, {"w": fills[:3]}, model=MODEL)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()


def test_refuses_a_non_empty_target(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "x").write_text("")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        save_params(tmp_path / "ckpt", params_tree(), model=MODEL)


@pytest.mark.parametrize("damage", ["truncate", "record"])
def test_a_damaged_checkpoint_is_one_clear_error(tmp_path, damage):
    save_params(tmp_path / "ckpt", params_tree(), model=MODEL)
    if damage == "truncate":
        path = tmp_path / "ckpt" / ARRAYS / "embedding.npy"
        path.write_bytes(path.read_bytes()[:200])
        match = "embedding.npy"
    else:
        record = json.loads((tmp_path / "ckpt" / RECORD).read_text())
        record["arrays"]["embedding"]["shape"] = [16, 9]
        (tmp_path / "ckpt" / RECORD).write_text(json.dumps(record))
        match = r"embedding.npy holds float32\[16, 8\], the record says float32\[16, 9\]"
    with pytest.raises(CheckpointError, match=match):
        open_params(tmp_path / "ckpt")


@pytest.mark.parametrize("dtypes", [(np.float32, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                    (np.float32, ml_dtypes.bfloat16)])
@pytest.mark.parametrize("rows", [_READ + 37, 5])
def test_copies_are_transposes(dtypes, rows):
    """The strip-wise copy equals numpy's transpose, past one read block and at a ragged end,
    bit for bit (same dtype) or as numpy casts (another dtype)."""
    src_dtype, dst_dtype = dtypes
    src = np.random.default_rng(rows).standard_normal((rows, 24)).astype(src_dtype)
    dst = np.empty((24, rows), dst_dtype)
    _copy_into(dst, src, "transpose")
    np.testing.assert_array_equal(dst, src.T.astype(dst_dtype))
    heads = np.empty((rows, 4, 6), dst_dtype)  # a [heads*hd, embed] -> [embed, heads, hd] target
    _copy_into(heads, np.ascontiguousarray(src.T), "in_heads")
    np.testing.assert_array_equal(heads.reshape(rows, 24), src.astype(dst_dtype))
    vector = np.empty((rows, 24), dst_dtype)
    _copy_into(vector, src, "vector")
    np.testing.assert_array_equal(vector, src.astype(dst_dtype))
