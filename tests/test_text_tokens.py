"""Reading text for `jaxspeed tokenize` and `tokenizer train`: bytes that are not UTF-8 and
corpora without text are one-line errors that write nothing; `--errors replace` reads U+FFFD."""

import json

import numpy as np
import pytest

from jaxspeed.cli import main
from jaxspeed.data.text_tokens import load_tokenizer, read_documents, train_bpe
from jaxspeed.errors import ConfigError, JaxspeedError

TEXT = "the quick brown fox jumps over the lazy dog; " * 20
#: random bytes whose first bad one is at offset 2 (0xff is never UTF-8)
NOISE = b"ok" + b"\xff" + np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    (root / "a.txt").write_text(TEXT)
    return train_bpe([str(root / "a.txt")], vocab_size=280, out_dir=str(root / "tok"))


def run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def commands(files, tokenizer, tmp_path, *flags):
    """`tokenize` and `tokenizer train` of `files`, each as its argv and the file it writes."""
    return {
        "tokenize": ([
            "tokenize", *files, "--tokenizer", tokenizer, "--out", str(tmp_path / "t.npy"),
            "--no-progress", *flags], tmp_path / "t.npy"),
        "tokenizer": ([
            "tokenizer", "train", *files, "--vocab-size", "280", "--out", str(tmp_path / "tok2"),
            *flags], tmp_path / "tok2"),
    }


@pytest.mark.parametrize("command", ["tokenize", "tokenizer"])
@pytest.mark.parametrize(
    "name, data, offset, byte",
    [("latin1.txt", "café naïve\n".encode("latin-1"), 3, 0xE9), ("noise.txt", NOISE, 2, 0xFF)],
    ids=["latin-1", "random-bytes"],
)
def test_bytes_that_are_not_utf8_are_one_line_naming_the_file_and_byte(
        tmp_path, capsys, tokenizer, command, name, data, offset, byte):
    path = tmp_path / name
    path.write_bytes(data)
    argv, _ = commands([str(path)], tokenizer, tmp_path)[command]
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err == (f"jaxspeed {command}: error: {path}: not UTF-8: byte 0x{byte:02x} at offset "
                   f"{offset}: invalid {'continuation' if byte == 0xE9 else 'start'} byte; "
                   "--errors replace reads such bytes as U+FFFD\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # nothing written, no partials


def test_a_jsonl_error_names_the_line_too(tmp_path):
    path = tmp_path / "d.jsonl"
    first = json.dumps({"text": "ok"}) + "\n"
    path.write_bytes(first.encode() + b'{"text": "caf\xe9"}\n')
    with pytest.raises(JaxspeedError, match=rf"d.jsonl: not UTF-8: byte 0xe9 at offset {len(first) + 13} \(line 2\)"):
        list(read_documents(str(path)))
    assert list(read_documents(str(path), errors="replace")) == ["ok", "caf\ufffd"]


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_errors_replace_reads_each_bad_byte_as_u_fffd(tmp_path, capsys, tokenizer, suffix):
    path = tmp_path / f"latin1{suffix}"
    text = "café naïve"
    data = text.encode("latin-1")
    path.write_bytes(data if suffix == ".txt" else b'{"text": "' + data + b'"}\n')
    argv, written = commands([str(path)], tokenizer, tmp_path, "--errors", "replace")["tokenize"]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    assert json.loads(out)["tokens"] == len(np.load(written))
    tok = load_tokenizer(tokenizer)
    assert tok.decode(np.load(written)[:-1].tolist()) == "caf\ufffd na\ufffdve"


def test_errors_accepts_strict_or_replace(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"errors: got 'ignore'; accepted \['strict', 'replace'\]"):
        list(read_documents(str(tmp_path / "a.txt"), errors="ignore"))


@pytest.mark.parametrize("command, what", [("tokenize", "tokenize"), ("tokenizer", "train a tokenizer on")])
@pytest.mark.parametrize("files", [["empty.txt"], ["empty.txt", "empty.jsonl"]], ids=["txt", "txt+jsonl"])
def test_a_corpus_without_text_is_refused(tmp_path, capsys, tokenizer, command, what, files):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "empty.txt").write_text("")
    (corpus / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n\n")
    paths = [str(corpus / f) for f in files]
    argv, written = commands(paths, tokenizer, tmp_path)[command]
    code, out, err = run(capsys, argv)
    assert code == 2 and out == ""
    assert err == f"jaxspeed {command}: error: files: no text in {', '.join(paths)}: nothing to {what}\n"
    assert not written.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_some_text_among_empty_documents_is_tokenized(tmp_path, capsys, tokenizer):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a.txt").write_text("fox")
    argv, written = commands([str(tmp_path / "empty.txt"), str(tmp_path / "a.txt")], tokenizer,
                             tmp_path)["tokenize"]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    eos = load_tokenizer(tokenizer).token_to_id("<|endoftext|>")
    tokens = np.load(written)
    assert tokens[0] == eos and tokens[-1] == eos and len(tokens) > 2  # one EOS per document
