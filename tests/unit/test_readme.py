"""The README stays short, its links and the docs pages' resolve, and every command it shows is run
by a test: RUN_BY names the test for each, and each command's words must be in that test's
source (or a helper module of ours it imports) as it runs them."""

import ast
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 350

# README command (normalized: shlex words joined by one space, no comment) -> the file that runs
# it. A `tandem`, `docker compose` or `make` command run by a Python test: every word after the
# program is a string literal there (`make T`: the words of T's recipe after `tandem`). A command
# run by a script (`.ci/run`): the script holds the command itself.
RUN_BY = {
    "make up": "tests/integration/test_launcher.py",
    "make test": ".ci/run",
    "tandem up --mode colocated --no-demo": "tests/integration/test_launcher.py",
    "tandem generate 'What is the capital of France?' --max-tokens 16": (
        "tests/integration/test_readme_and_cli.py"
    ),
    "tandem status": "tests/integration/test_readme_and_cli.py",
    "tandem api-keys --new keys.json --name team-a": "tests/unit/test_api_keys.py",
    "tandem up --mode disaggregated --prefill-tp 3 --no-demo": (
        "tests/integration/test_tensor_parallel.py"
    ),
    "tandem scale decode=2 --wait": "tests/integration/test_scaling.py",
    "tandem scale decode=1 --wait": "tests/integration/test_scaling.py",
    "docker compose up --detach --wait": "tests/integration/test_docker_compose.py",
    "docker compose up --detach --wait --no-recreate --scale decode=2": (
        "tests/integration/test_docker_compose.py"
    ),
    "docker compose down --volumes": "tests/integration/test_docker_compose.py",
}
PROGRAMS = (("docker", "compose"), ("tandem",), ("make",))
SHELL_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def normalize(command: str) -> str:
    return " ".join(shlex.quote(word) for word in shlex.split(command, comments=True))


def shown_commands(text: str) -> list[str]:
    """Every shell command in the fenced blocks: each line of a bash/sh/shell block (`\\`
    continuations joined, comments dropped), and each `$ ` line of any block."""
    commands = []
    for lang, body in SHELL_BLOCK.findall(text):
        lines = body.replace("\\\n", " ").splitlines()
        if lang in ("bash", "sh", "shell"):
            picked = [line.removeprefix("$ ") for line in lines]
        else:
            picked = [line[2:] for line in lines if line.startswith("$ ")]
        commands += [normalize(line) for line in picked if normalize(line)]
    return commands


def unmapped(text: str, run_by: dict[str, str] = RUN_BY) -> list[str]:
    return [command for command in shown_commands(text) if command not in run_by]


def module_path(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def sources(test: Path) -> list[Path]:
    """The test file and the modules of ours outside the runtime that it imports (its drivers)."""
    found = [test]
    for node in ast.walk(ast.parse(test.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            path = module_path(name) if name.split(".")[0] in ("tests", "harness") else None
            if path is not None and path not in found:
                found.append(path)
    return found


def string_literals(paths: list[Path]) -> set[str]:
    return {
        node.value
        for path in paths
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def make_recipe(target: str) -> str:
    match = re.search(
        rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)", (ROOT / "Makefile").read_text(), re.M
    )
    assert match, f"the Makefile has no target {target}"
    return match.group(1)


def words_to_find(command: str) -> list[str]:
    """The words a Python test must hold as string literals to run `command`."""
    words = shlex.split(command)
    for program in PROGRAMS:
        if tuple(words[: len(program)]) == program:
            words = words[len(program) :]
            break
    else:
        raise AssertionError(f"{command}: not a tandem, docker compose or make command")
    if program == ("make",):  # what the target runs: `tandem ...`
        runs = re.search(r"\btandem ([^\n]*)", make_recipe(words[0]))
        assert runs, f"{command}: its recipe runs no `tandem` command a test could run"
        return shlex.split(runs.group(1))
    return words


def not_run(run_by: dict[str, str] = RUN_BY) -> list[str]:
    """Each mapped command its file does not run, and why."""
    problems = []
    for command, file in run_by.items():
        path = ROOT / file
        if not path.is_file():
            problems.append(f"{command}: {file} does not exist")
        elif path.suffix != ".py":
            if command not in path.read_text():
                problems.append(f"{command}: not in {file}")
        else:
            missing = [w for w in words_to_find(command) if w not in string_literals(sources(path))]
            if missing:
                problems.append(f"{command}: {file} never says {missing}")
    return problems


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    text = SHELL_BLOCK.sub("", text)  # a `# comment` in a code block is not a heading
    found = {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return found | set(re.findall(r'<a id="([^"]+)"', text))


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(SHELL_BLOCK.sub("", path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


def test_every_link_in_the_readme_and_the_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert [b for page in pages for b in broken_links(page)] == []


def test_the_readme_links_every_docs_page():
    linked = {
        (ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(README.read_text())
    }
    pages = set((ROOT / "docs").glob("*.md"))
    assert sorted(p.name for p in pages - linked) == []


def test_every_command_the_readme_shows_is_run_by_a_test():
    text = README.read_text()
    assert shown_commands(text), "found no command in the README: the extraction is broken"
    assert unmapped(text) == [], "add each to RUN_BY with the test that runs it, or drop it"
    assert sorted(set(RUN_BY) - set(shown_commands(text))) == [], "RUN_BY has stale entries"
    assert not_run() == []


def test_the_check_fails_on_an_unmapped_or_unrun_command():
    fake = (
        "# Fake\n\n```sh\nmake up   # fine\ntandem up --mode disaggregated --frobnicate\n```\n\n"
        "```console\n$ tandem status\nworker  role\n```\n\n```python\nprint('no shell')\n```\n"
    )
    assert shown_commands(fake) == [
        "make up",
        "tandem up --mode disaggregated --frobnicate",
        "tandem status",
    ]
    assert unmapped(fake) == ["tandem up --mode disaggregated --frobnicate"]
    wrong = {"tandem up --frobnicate": "tests/integration/test_launcher.py"}
    assert not_run(wrong) == [
        "tandem up --frobnicate: tests/integration/test_launcher.py never says ['--frobnicate']"
    ]
    assert not_run({"make lint": ".ci/run"}) == ["make lint: not in .ci/run"]


def test_anchors_follow_githubs_rules():
    assert slug("The control plane at scale: mock engines") == (
        "the-control-plane-at-scale-mock-engines"
    )
    assert slug("Routing (`router.py`, `cost.py`)") == "routing-routerpy-costpy"
    assert slug("OpenAI-compatible HTTP API") == "openai-compatible-http-api"


def test_the_link_check_fails_on_a_missing_page_or_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## A section: `x`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-section-x) [ok](#page) [web](https://example.com)\n"
        "[gone](missing.md) [no heading](other.md#nothing) ![img](other.md)\n"
        "```sh\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nothing (no such heading)",
    ]
