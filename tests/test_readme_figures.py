"""README.md's quoted command outputs are today's (`tools/readme_figures.py`).

The suite checks the cheapest generated figures by running them (the launcher's failing rank
and `plan --distributed` outside a cluster, a few seconds each); the `plan` tables of gpt_1b_offload take minutes each on 2 cores and are checked by
`tools/readme_figures.py --check`, a manual step (README, "Testing"). The other tests edit a
temporary copy of the README and need no command run.
"""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "readme_figures.py"
CHEAP = ("launch-rank-fails", "plan-distributed-outside-cluster")


def _module():
    spec = importlib.util.spec_from_file_location("readme_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check(readme: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--only", *names, "--readme", str(readme)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_every_figure_has_its_marker_in_the_readme():
    figures = _module()
    assert set(figures.regions((ROOT / "README.md").read_text())) == set(figures.FIGURES)


def test_quoted_figure_is_todays_output_and_an_edit_fails_the_check(tmp_path):
    proc = _check(ROOT / "README.md", *CHEAP)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    edited = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    quoted = "rank 1 exited with code 1;"
    assert text.count(quoted) == 1
    edited.write_text(text.replace(quoted, "rank 1 exited with code 2;"))
    proc = _check(edited, CHEAP[0])
    assert proc.returncode == 1
    assert f"README.md: {CHEAP[0]} (quoted)" in proc.stdout
    assert "-jaxspeed launch: rank 1 exited with code 2;" in proc.stdout
    assert "+jaxspeed launch: rank 1 exited with code 1;" in proc.stdout


def test_an_edited_plan_figure_is_named_by_the_check(tmp_path):
    """A memory column off by its last printed digit is a difference (tolerance: none); the
    README's own block stands in for today's output, so no plan is compiled."""
    figures = _module()
    text = (ROOT / "README.md").read_text()
    name = "plan-gpt-1b-offload-streamed"
    start, end = figures.regions(text)[name]
    block = text[start:end]
    line = next(line for line in block.splitlines() if line.startswith("params "))
    changed = re.sub(r"(\d) MiB", lambda m: f"{(int(m[1]) + 1) % 10} MiB", line, count=1)
    assert changed != line
    edited = text[:start] + block.replace(line, changed, 1) + text[end:]
    assert figures.check(text, {name: block}) == []
    (problem,) = figures.check(edited, {name: block})
    assert f"README.md: {name} (quoted)" in problem
    assert f"-{changed}" in problem and f"+{line}" in problem
    assert figures.write(edited, {name: block}) == text
