"""The `jaxspeed` parser: an unknown flag is reported by the command it follows, with its usage."""

import argparse

import pytest

from jaxspeed.cli.parser import build_parser

#: each command, as its words, with the least it needs to parse
VALID = {
    "train": ["train", "c.yaml"],
    "plan": ["plan", "c.yaml"],
    "calibrate": ["calibrate", "--out", "c.yaml"],
    "bench": ["bench", "zero_memory"],
    "export": ["export", "runs/x", "--out", "p.msgpack"],
    "import-hf": ["import-hf", "hf", "--out", "ckpt"],
    "tokenize": ["tokenize", "a.txt", "--tokenizer", "tok", "--out", "t.npy"],
    "tokenizer train": ["tokenizer", "train", "a.txt", "--vocab-size", "300", "--out", "tok"],
    "sample": ["sample", "runs/x", "--prompt", "hi"],
    "launch": ["launch", "--nproc", "2"],
}


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> list[str]:
    """Every leaf command of `parser`, as its words joined by spaces."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [" ".join(words)]
    return [name for word, child in subs[0].choices.items() for name in _commands(child, (*words, word))]


def test_every_command_is_checked():
    assert sorted(_commands(build_parser())) == sorted(VALID)


@pytest.mark.parametrize("command", sorted(VALID))
def test_the_valid_words_parse(command):
    build_parser().parse_args(VALID[command])


@pytest.mark.parametrize(
    "command, where",
    # after `bench NAME`, every word is the benchmark's (test_arguments_after_a_remainder...)
    [(c, w) for c in sorted(VALID) for w in ("end", "after-command") if (c, w) != ("bench", "end")],
)
def test_an_unknown_flag_shows_the_commands_usage(command, where, capsys):
    words = list(VALID[command])
    depth = len(command.split())
    argv = [*words, "--bogus"] if where == "end" else [*words[:depth], "--bogus", *words[depth:]]
    if command == "launch":  # its command comes after `--`, and is the command's own
        argv = [*argv, "--", "echo", "--bogus2"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith(f"usage: jaxspeed {command} "), err
    assert err.endswith(f"jaxspeed {command}: error: unrecognized arguments: --bogus\n"), err


def test_arguments_after_a_remainder_are_the_commands_own():
    args = build_parser().parse_args(["bench", "zero_memory", "--bogus"])
    assert args.args == ["--bogus"]
    args = build_parser().parse_args(["launch", "--nproc", "2", "--", "echo", "--bogus"])
    assert args.cmd[-1] == "--bogus"
