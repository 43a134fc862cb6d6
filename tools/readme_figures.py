"""The README's quoted command outputs, produced by today's code.

    python tools/readme_figures.py            # run every figure's command, print the fresh blocks
    python tools/readme_figures.py --check    # compare README.md's blocks with them; exit 1 on a difference
    python tools/readme_figures.py --write    # rewrite README.md's blocks in place
        [--only NAME ...] [--readme PATH] [--list]

A generated figure in README.md starts at a marker line, `<!-- readme_figures: NAME -->`, and is
the fenced block(s) right below it:

- `output` figures: a ```bash block holding the command as shown, then a ``` block holding
  what the command prints on stdout (the `plan` tables from their `per device` line on: the
  per-parameter sharding table above it is left out);
- `console` figures: one ```console block, `$ COMMAND` followed by what it prints (stdout and
  stderr together, as a terminal shows them).

The commands are this file's `FIGURES` (the README shows them as written here; `.venv/bin/` is
run as the venv of the Python running this script), run from the repository root with
`XLA_FLAGS` removed from the environment, so that they compile at XLA's default level as a
user's run does (the test suite's fast level gives other temp bytes).

Tolerance: none. Every generated figure is deterministic for a given jax/jaxlib: the `plan`
tables' bytes (estimate and compiled memory columns, collective bytes) and FLOPs are read from
the sharding and XLA's compiled program and printed rounded, and the launcher's messages are
fixed text. `--check` therefore compares the blocks as text (trailing spaces ignored), which is
"exact to the printed rounding". Nothing timing-derived is generated: the `plan --auto`
tables (minutes each), `make train`'s losses (300 steps) and every benchmark are quoted in the
README with the date and the command that produced them, and this script leaves them alone.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- readme_figures: (?P<name>[\w.-]+) -->$")


class Figure(NamedTuple):
    """A command as the README shows it and how its output is quoted."""

    command: str  # display form; `\` + newline continues a line
    kind: str  # "output" (stdout after a ```bash block) or "console" ($ command + stdout/stderr)
    cost: str  # what it took on 2 CPU cores shared with ~20 busy processes (2026-12-07), for --list
    start: str = ""  # quote the output from the first line that starts with this on


OFFLOAD = ".venv/bin/jaxspeed plan configs/gpt_1b_offload.yaml --cpu-devices 8 --device-memory 2GiB"

PER_DEVICE = "per device "  # the plan tables are quoted from here on, the sharding table left out

FIGURES: dict[str, Figure] = {
    "plan-gpt-1b-offload": Figure(OFFLOAD, "output", "61 s CPU, 8 min wall", PER_DEVICE),
    "plan-gpt-1b-offload-streamed": Figure(
        OFFLOAD + " \\\n"
        "  --set zero_optimization.offload_optimizer.device=cpu \\\n"
        "  --set zero_optimization.offload_optimizer.update_on=host \\\n"
        "  --set zero_optimization.offload_param.device=cpu",
        "output", "19 s CPU, 3.6 min wall", PER_DEVICE),
    "launch-rank-fails": Figure(
        ".venv/bin/jaxspeed launch --nproc 2 -- .venv/bin/python -c 'import os, sys, time\n"
        'if os.environ["JAXSPEED_PROCESS_ID"] == "1": sys.exit("rank 1: out of data")\n'
        "time.sleep(600)'",
        "console", "2 s CPU, 27 s wall"),
    "plan-distributed-outside-cluster": Figure(
        ".venv/bin/jaxspeed plan configs/gpt_tiny.yaml --distributed", "console",
        "1.5 s CPU, 27 s wall"),
}


def argv(command: str) -> list[str]:
    """The command's arguments, `.venv/bin/X` taken from this interpreter's venv."""
    bin_dir = Path(sys.executable).parent
    words = shlex.split(command.replace("\\\n", " "))
    return [str(bin_dir / w.removeprefix(".venv/bin/")) if w.startswith(".venv/bin/") else w
            for w in words]


def run(figure: Figure, *, timeout: float = 1800) -> str:
    """What the figure's command prints (its exit status is part of what is quoted, not checked)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAXSPEED_PROGRESS_SECONDS", "100000")
    proc = subprocess.run(
        argv(figure.command), cwd=ROOT, env=env, text=True, timeout=timeout,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if figure.kind == "console" else subprocess.PIPE,
    )
    if figure.kind == "output" and proc.returncode != 0:
        raise RuntimeError(f"{figure.command!r} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return excerpt(figure, proc.stdout)


def excerpt(figure: Figure, output: str) -> str:
    """The quoted part of an output, trailing spaces dropped."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()]
    if figure.start:
        starts = [i for i, line in enumerate(lines) if line.startswith(figure.start)]
        if not starts:
            raise RuntimeError(f"{figure.command!r} printed no line starting {figure.start!r}")
        lines = lines[starts[0]:]
    return "\n".join(lines) + "\n"


def render(figure: Figure, output: str) -> str:
    """The README text below the figure's marker."""
    if figure.kind == "console":
        return f"```console\n$ {figure.command}\n{output}```\n"
    return f"```bash\n{figure.command}\n```\n```\n{output}```\n"


def _fences(kind: str) -> int:
    return 2 if kind == "output" else 1


def regions(text: str) -> dict[str, tuple[int, int]]:
    """NAME -> (start, end) character offsets of the blocks below each marker."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    found: dict[str, tuple[int, int]] = {}
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if not match:
            continue
        name = match["name"]
        if name not in FIGURES:
            raise SystemExit(f"README marker names an unknown figure: {name}")
        j, fences = i + 1, _fences(FIGURES[name].kind)
        for _ in range(fences):
            if j >= len(lines) or not lines[j].startswith("```"):
                raise SystemExit(f"figure {name}: expected a fenced block at README line {j + 1}")
            j += 1
            while j < len(lines) and lines[j].rstrip("\n") != "```":
                j += 1
            j += 1
        found[name] = (offsets[i + 1], offsets[min(j, len(lines))])
    return found


def diff(name: str, quoted: str, fresh: str) -> str:
    return "".join(difflib.unified_diff(
        quoted.splitlines(keepends=True), fresh.splitlines(keepends=True),
        fromfile=f"README.md: {name} (quoted)", tofile=f"{name} (today's output)"))


def _strip(block: str) -> str:
    return "\n".join(line.rstrip() for line in block.splitlines())


def check(text: str, fresh: dict[str, str]) -> list[str]:
    """One diff per figure whose README block is not today's; a missing marker is one too."""
    where = regions(text)
    problems = []
    for name, block in fresh.items():
        if name not in where:
            problems.append(f"README.md has no marker <!-- readme_figures: {name} -->\n")
            continue
        quoted = text[slice(*where[name])]
        if _strip(quoted) != _strip(block):
            problems.append(diff(name, quoted, block))
    return problems


def write(text: str, fresh: dict[str, str]) -> str:
    where = regions(text)
    for name in sorted(fresh, key=lambda n: where[n][0], reverse=True):
        start, end = where[name]
        text = text[:start] + fresh[name] + text[end:]
    return text


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="compare README.md's blocks; exit 1 on a difference")
    mode.add_argument("--write", action="store_true", help="rewrite README.md's blocks in place")
    mode.add_argument("--list", action="store_true", help="list the figures and their commands")
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(FIGURES), help="these figures only")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md")
    opts = parser.parse_args(args)
    names = opts.only or list(FIGURES)
    if opts.list:
        for name in names:
            print(f"{name} ({FIGURES[name].kind}, {FIGURES[name].cost}): {FIGURES[name].command}")
        return 0
    fresh = {}
    for name in names:
        print(f"readme_figures: running {name}", file=sys.stderr, flush=True)
        fresh[name] = render(FIGURES[name], run(FIGURES[name]))
    text = opts.readme.read_text()
    if opts.check:
        problems = check(text, fresh)
        sys.stdout.writelines(problems)
        if problems:
            print(f"readme_figures: {len(problems)} of {len(names)} figures differ from today's output "
                  f"(tolerance: none; rewrite them with --write)", file=sys.stderr)
            return 1
        print(f"readme_figures: {len(names)} figures match today's output", file=sys.stderr)
        return 0
    if opts.write:
        opts.readme.write_text(write(text, fresh))
        print(f"readme_figures: rewrote {len(names)} figures in {opts.readme}", file=sys.stderr)
        return 0
    for name in names:
        print(f"<!-- readme_figures: {name} -->\n{fresh[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
