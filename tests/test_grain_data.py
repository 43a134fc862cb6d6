"""Token-file data through Grain: order, sharding, resume, packing, tokenizing, and errors."""

import json
import random

import grain
import numpy as np
import pytest

from jaxspeed.cli import main
from jaxspeed.config import load_config
from jaxspeed.errors import ConfigError, JaxspeedError
from jaxspeed.data.grain_loader import GrainTokenDataset, make_dataset
from jaxspeed.data.packing import segment_ids_and_positions
from jaxspeed.data.text_tokens import load_tokenizer, train_bpe
from jaxspeed.data.token_files import TokenRows

WORDS = "the a data model token grain shard batch step loss seed row file text jax mesh".split()
TINY_MODEL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 16, "vocab_size": 512}


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "." for _ in range(n)]


def stream(num_tokens: int = 2000, vocab: int = 100, eos_id: int = 0) -> np.ndarray:
    """A token stream of random documents (ids 1..vocab-1) each ended by `eos_id`."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=num_tokens).astype(np.uint16)
    tokens[rng.random(num_tokens) < 0.05] = eos_id
    return tokens


def dataset(seed: int = 0, **kwargs) -> GrainTokenDataset:
    kwargs = {"seq_len": 8, "vocab_size": 100, "eos_id": 0, "packing": True, **kwargs}
    return GrainTokenDataset([stream()], seed=seed, **kwargs)


def shard(index: int, count: int) -> grain.sharding.ShardOptions:
    return grain.sharding.ShardOptions(shard_index=index, shard_count=count)


def take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def assert_batches_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_batch_has_int32_rows_of_seq_len():
    batch = dataset().batch(0, global_batch=4)
    assert set(batch) == {"inputs", "targets", "segment_ids", "positions"}
    for value in batch.values():
        assert value.shape == (4, 8) and value.dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])


def test_same_seed_same_batches_other_seed_differs():
    first = [dataset(seed=3).batch(s, global_batch=4) for s in range(3)]
    again = [dataset(seed=3).batch(s, global_batch=4) for s in range(3)]
    other = [dataset(seed=4).batch(s, global_batch=4) for s in range(3)]
    for a, b in zip(first, again):
        assert_batches_equal(a, b)
    assert any(not np.array_equal(a["inputs"], c["inputs"]) for a, c in zip(first, other))


def test_iterator_matches_random_access_batches():
    data = dataset()
    it = data.iterator(global_batch=4, shard=shard(0, 1))
    for step, batch in enumerate(take(it, 4)):
        assert_batches_equal(batch, data.batch(step, global_batch=4))


def test_an_epoch_covers_every_row_once_and_reshuffles():
    data = GrainTokenDataset([np.arange(161, dtype=np.uint16)], seq_len=4, vocab_size=161, eval_fraction=0.0)
    rows = data.num_rows()  # 40 rows: every 4th token starts one
    epochs = [np.concatenate([data.batch(s, global_batch=8)["inputs"][:, 0] for s in range(e * 5, e * 5 + 5)])
              for e in range(2)]
    for starts in epochs:
        np.testing.assert_array_equal(np.sort(starts), np.arange(rows) * 4)
    assert not np.array_equal(epochs[0], epochs[1])


@pytest.mark.parametrize("count", [2, 4])
def test_processes_together_read_exactly_the_rows_one_process_reads(monkeypatch, count):
    reads: dict[int, list[int]] = {}
    current = {"process": 0}
    original = TokenRows.__getitem__

    def recording(self, index):
        reads.setdefault(current["process"], []).append(index)
        return original(self, index)

    monkeypatch.setattr(TokenRows, "__getitem__", recording)
    data = dataset()
    steps = range(6)
    one = [data.batch(s, global_batch=8) for s in steps]
    whole = sorted(reads.pop(0))
    for p in range(count):
        current["process"] = p + 1
        parts = [data.batch(s, global_batch=8, process_index=p, process_count=count) for s in steps]
        for s in steps:
            np.testing.assert_array_equal(parts[s]["inputs"], one[s]["inputs"][p * 8 // count : (p + 1) * 8 // count])
    per_process = [reads[p + 1] for p in range(count)]
    assert sorted(i for r in per_process for i in r) == whole
    assert all(len(r) == len(whole) // count for r in per_process)


@pytest.mark.parametrize("before, after", [(1, 1), (1, 2), (2, 1), (2, 4)])
def test_resume_from_saved_state_continues_at_the_same_example(before, after):
    data = dataset()
    running = [data.iterator(global_batch=8, shard=shard(p, before)) for p in range(before)]
    for it in running:
        take(it, 3)
    states = [json.loads(json.dumps(it.get_state())) for it in running]  # saved as JSON
    assert all(s == states[0] for s in states)  # the state does not depend on the process
    expected = [np.concatenate([next(it)["inputs"] for it in running]) for _ in range(2)]
    resumed = [data.iterator(global_batch=8, shard=shard(p, after), state=states[0]) for p in range(after)]
    got = [np.concatenate([next(it)["inputs"] for it in resumed]) for _ in range(2)]
    for e, g in zip(expected, got):
        np.testing.assert_array_equal(g, e)


def reference_segments(row: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    segment, position, segments, positions = 1, 0, [], []
    for i, token in enumerate(row):
        if i and row[i - 1] == eos_id:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


def test_packing_segment_ids_and_positions_on_a_hand_made_corpus():
    eos = 9
    docs = [[1, 2, 3], [4, 5], [6], [7, 8, 1, 2, 3, 4]]
    tokens = np.array([t for d in docs for t in (*d, eos)], dtype=np.uint16)
    data = GrainTokenDataset([tokens], seq_len=6, vocab_size=10, eos_id=eos, packing=True, eval_fraction=0.0)
    rows = np.stack([data._rows["train"][i] for i in range(data.num_rows())])
    np.testing.assert_array_equal(rows[0], [1, 2, 3, 9, 4, 5, 9])
    seg, pos = segment_ids_and_positions(rows[:, :-1], eos_id=eos)
    np.testing.assert_array_equal(seg[0], [1, 1, 1, 1, 2, 2])
    np.testing.assert_array_equal(pos[0], [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(seg[1], [1, 2, 2, 3, 3, 3])  # row starts on the EOS of doc 2
    np.testing.assert_array_equal(pos[1], [0, 0, 1, 0, 1, 2])
    for row, s, p in zip(rows[:, :-1], seg, pos):
        ref_s, ref_p = reference_segments(list(row), eos)
        assert list(s) == ref_s and list(p) == ref_p
    rng = np.random.default_rng(1)
    random_rows = rng.integers(0, 4, size=(5, 12))
    seg, pos = segment_ids_and_positions(random_rows, eos_id=0)
    for row, s, p in zip(random_rows, seg, pos):
        assert (list(s), list(p)) == reference_segments(list(row), 0)


def test_without_packing_only_inputs_and_targets():
    assert set(dataset(packing=False).batch(0, global_batch=2)) == {"inputs", "targets"}


# --- files, tokenizers, config --------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A few KB of text as .txt and .jsonl files, and a 300-token BPE trained on them."""
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(120)
    (root / "a.txt").write_text("\n".join(docs[:40]))
    (root / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[40:]))
    tokenizer = train_bpe([str(root / "a.txt")], vocab_size=300, out_dir=str(root / "tok"))
    return root, docs, tokenizer


def config(tmp_path, **data):
    return load_config({
        "mesh": {"data": -1}, "train_micro_batch_size_per_device": 1, "model": TINY_MODEL,
        "data": {"seq_len": 16, "cache_dir": str(tmp_path / "cache"), **data},
        "checkpoint": {"every_n_steps": 1}, "logging": {"every_n_steps": 1}, "steps": 2,
    })


def test_text_source_tokenizes_once_with_eos_after_each_document(tmp_path, corpus, monkeypatch):
    root, docs, tokenizer_path = corpus
    cfg = config(tmp_path, source="text", files=[str(root / "b.jsonl")], tokenizer=tokenizer_path,
                 text_key="body", packing=True)
    data = make_dataset(cfg)
    tokenizer = load_tokenizer(tokenizer_path)
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert data.eos_id == eos and data.vocab_size == 300
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1
    tokens = np.load(cached[0])
    pieces = np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]
    assert [tokenizer.decode(list(p[:-1])) for p in pieces] == docs[40:]

    def no_second_tokenize(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr("jaxspeed.data.text_tokens.tokenize_files", no_second_tokenize)
    assert_batches_equal(make_dataset(cfg).batch(0, global_batch=4), data.batch(0, global_batch=4))


def test_parquet_text_source(tmp_path, corpus):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    root, docs, tokenizer_path = corpus
    pq.write_table(pa.table({"text": docs}), str(tmp_path / "d.parquet"))
    cfg = config(tmp_path, source="text", files=str(tmp_path / "d.parquet"), tokenizer=tokenizer_path)
    assert make_dataset(cfg).num_rows() > 10


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_token_file_size_not_divisible_by_dtype(tmp_path, capsys):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    cfg = config(tmp_path, source="tokens", files=str(tmp_path / "odd.bin"), dtype="uint16")
    with pytest.raises(JaxspeedError, match="5 bytes is not a whole number of uint16 tokens"):
        make_dataset(cfg)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.model_dump(by_alias=True, exclude_none=True)))
    assert main(["train", str(path), "--output", str(tmp_path / "run")]) == 2
    assert "not a whole number of uint16 tokens" in one_error_line(capsys)


def test_tokenizer_vocab_larger_than_model_vocab(tmp_path, corpus, capsys):
    root, _, tokenizer_path = corpus
    cfg = config(tmp_path, source="text", files=str(root / "a.txt"), tokenizer=tokenizer_path)
    cfg = load_config(cfg, overrides=["model.vocab_size=256"])
    with pytest.raises(ConfigError, match="model.vocab_size=256 is smaller than the tokenizer's vocabulary"):
        make_dataset(cfg)
    assert not (tmp_path / "cache").exists()  # refused before tokenizing


def test_token_ids_beyond_model_vocab(tmp_path):
    np.save(tmp_path / "t.npy", np.array([1, 2, 600, 3] * 10, dtype=np.uint16))
    with pytest.raises(ConfigError, match="largest id 600"):
        make_dataset(config(tmp_path, source="tokens", files=str(tmp_path / "t.npy")))


@pytest.mark.parametrize("source", ["tokens", "text"])
def test_missing_file(tmp_path, corpus, source, capsys):
    extra = {"tokenizer": corpus[2]} if source == "text" else {}
    missing = str(tmp_path / ("nope.npy" if source == "tokens" else "nope.txt"))
    with pytest.raises(JaxspeedError, match="nope.* does not exist"):
        make_dataset(config(tmp_path, source=source, files=[missing], **extra))
    assert main(["tokenize", missing, "--tokenizer", corpus[2], "--out", str(tmp_path / "o.npy")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_cli_tokenizer_train_and_tokenize(tmp_path, corpus, capsys):
    root, docs, _ = corpus
    assert main(["tokenizer", "train", "--vocab-size", "280", str(root / "a.txt"), "--out", str(tmp_path / "tok")]) == 0
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer.get_vocab_size() == 280 and tokenizer.token_to_id("<|endoftext|>") is not None
    capsys.readouterr()
    out = tmp_path / "tokens.bin"
    argv = ["tokenize", str(root / "b.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--out", str(out),
            "--text-key", "body", "--no-progress"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    tokens = np.fromfile(out, dtype=result["dtype"])
    assert result["dtype"] == "uint16" and len(tokens) == result["tokens"]
    assert np.count_nonzero(tokens == result["eos_id"]) == len(docs) - 40
    assert tokenizer.decode(list(tokens[: np.argmax(tokens == result["eos_id"])])) == docs[40]


def test_cli_tokenizer_train_rejects_tiny_vocab(tmp_path, corpus, capsys):
    assert main(["tokenizer", "train", "--vocab-size", "100", str(corpus[0] / "a.txt"), "--out", str(tmp_path)]) == 2
    assert "--vocab-size" in one_error_line(capsys)


def test_train_on_token_files_saves_and_resumes_the_iterator(tmp_path):
    from jaxspeed.checkpoint import Checkpointer
    from jaxspeed.train.loop import train

    np.save(tmp_path / "a.npy", stream(3000, vocab=500))
    stream(1000, vocab=500).astype(np.uint32).tofile(tmp_path / "b.bin")
    cfg = config(tmp_path, source="tokens", files=[str(tmp_path / "a.npy"), str(tmp_path / "b.bin")],
                 dtype="uint32")
    record = train(cfg, output_dir=tmp_path / "run", steps=2, progress=False)
    assert record["step"] == 2 and np.isfinite(record["loss"])
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")
    assert ckpt.read_meta(2)["data_state"] == {"next_index": 2}
    assert ckpt.read_meta(1)["data_state"] == {"next_index": 1}
    ckpt.close()
    record = train(cfg, output_dir=tmp_path / "run", steps=3, progress=False)
    assert record["step"] == 3


def test_engine_places_packed_batches(tmp_path):
    from jaxspeed.train.engine import initialize

    np.save(tmp_path / "a.npy", stream(3000, vocab=500))
    cfg = config(tmp_path, source="tokens", files=str(tmp_path / "a.npy"), packing=True, eos_id=0)
    engine = initialize(cfg)
    local = make_dataset(cfg).batch(0, global_batch=engine.batch_sizes.train_batch_size)
    placed = engine.shard_batch(local)
    assert set(placed) == {"inputs", "targets", "segment_ids", "positions"}
    for key, value in placed.items():
        assert value.shape == (engine.batch_sizes.train_batch_size, 16) and value.dtype == np.int32
        assert value.sharding == engine.batch_sharding(2)
        np.testing.assert_array_equal(np.asarray(value), local[key])
