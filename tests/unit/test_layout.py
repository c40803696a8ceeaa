"""The folders are the architecture: each package imports only what the README's layout table
allows. The library never imports a service, services never import each other, and nothing in the
runtime path imports the `tandem` command, the benchmark client or a test fake. What benchmarks and
tests share (KV peers, model layouts, the compose driver) lives in `harness/`: tests may import it,
it never imports a test or a benchmark, and nothing outside tests/ imports from tests/."""

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = {
    "shared.settings",
    "shared.lifecycle",
    "shared.model_store",
    "shared.job_thread",
    "shared.telemetry",
    "shared.values",
}  # leaves
RUNTIME = {
    "shared.values",
    "shared.parallel",
    "shared.control",
    "shared.engine",
    "shared.dataplane",
    "shared.kvtransfer",
    "shared.worker",
    "shared.api",
    "shared.grammar",
}
# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "shared.values": set(),  # what the engine and the control plane share: imports neither
    "shared.parallel": {"shared.values", "shared.engine"},  # tensor-parallel groups
    "shared.control": {"shared.telemetry", "shared.values"},
    "shared.api": set(),
    "shared.settings": {"shared.telemetry"},
    "shared.lifecycle": set(),
    "shared.model_store": set(),
    "shared.job_thread": set(),
    "shared.telemetry": set(),
    "shared.engine": {"shared.values"},  # no wire message
    "shared.grammar": {"shared.values"},  # structured outputs' grammars (llguidance)
    "shared.dataplane": {"shared.engine"},  # transports only: no control message
    "shared.kvtransfer": {
        "shared.job_thread",
        "shared.control",
        "shared.engine",
        "shared.dataplane",
        "shared.telemetry",
        "shared.parallel",
    },
    "shared.worker": {
        "shared.control",
        "shared.engine",
        "shared.dataplane",
        "shared.grammar",
        "shared.kvtransfer",
        "shared.parallel",
    }
    | COMMON,
    "shared.benchmark": {"shared.api"},
    "shared.cli": RUNTIME | COMMON | {"shared.benchmark"},
    "services.gateway": RUNTIME | COMMON,
    "services.scheduler": (RUNTIME | COMMON) - {"shared.engine"},  # places, never batches
    "services.prefill": RUNTIME | COMMON,
    "services.decode": RUNTIME | COMMON,
    "tests.fakes": RUNTIME | COMMON,
    # what benchmarks and tests share: the runtime to drive, the command's helpers for compose
    "harness": RUNTIME | COMMON | {"shared.cli"},
}
# top-level folder -> the top-level folders it may never import; every folder outside tests/
# (bench/, proto/, ...) may never import tests/ either
NEVER = {
    "shared": {"harness", "bench"},
    "services": {"harness", "bench"},
    "harness": {"bench"},
}
# not the repository's own code: virtualenvs, build outputs
NOT_OURS = {"build", "dist", "venv"}


def package_of(module: str) -> str | None:
    """The layout unit a dotted module name belongs to: `shared.<x>`, `services.<x>`, `tests.<x>`,
    or all of `harness` or `bench`."""
    parts = module.split(".")
    if parts[0] in ("harness", "bench"):
        return parts[0]
    if parts[0] in ("shared", "services", "tests") and len(parts) > 1:
        return ".".join(parts[:2])
    return None


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from shared import model_store` imports shared.model_store
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> list[Path]:
    """Every module in a layout unit (the top-level packages' own __init__ files are empty)."""
    folders = [ROOT / "shared", ROOT / "services", ROOT / "tests" / "fakes", ROOT / "harness"]
    paths = (p for folder in folders for p in folder.rglob("*.py"))
    return sorted(p for p in paths if package_of(module_name(p)))


def violations(path: Path, root: Path = ROOT) -> list[str]:
    module = module_name(path, root)
    own = package_of(module)
    allowed = ALLOWED[own] | {own}
    found = {package_of(name) for name in imported_modules(path)} - {None}
    return sorted(f"{module} imports {pkg}" for pkg in found - allowed)


def test_every_package_has_a_row_in_the_layout_table():
    assert {package_of(module_name(p)) for p in sources()} <= set(ALLOWED)


def test_the_top_level_packages_import_nothing():
    for top in ("shared", "services", "harness"):
        assert imported_modules(ROOT / top / "__init__.py") == set()


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_module_imports_only_what_its_package_may(path):
    assert violations(path) == []


def test_every_folder_of_python_modules_is_a_package():
    folders = {p.parent for p in sources()}
    assert [f for f in folders if not (f / "__init__.py").exists()] == []


def test_the_rule_catches_a_service_importing_another(tmp_path):
    """The check can fail: a gateway module that imports the decode service is reported."""
    bad = tmp_path / "services" / "gateway" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from services.decode.worker import DecodeWorker\nfrom tests.fakes import bus\n")
    assert violations(bad, root=tmp_path) == [
        "services.gateway.bad imports services.decode",
        "services.gateway.bad imports tests.fakes",
    ]


def outside_tests(root: Path = ROOT) -> list[Path]:
    """Every Python file of the repository outside tests/: bench/, harness/, shared/, services/,
    proto/ and any folder added later (hidden folders and NOT_OURS aside)."""
    paths = []
    for folder, dirs, files in os.walk(root):
        # pruned, not filtered: the virtualenvs (.venv, .venv-bench) are never walked
        skip = NOT_OURS | ({"tests"} if Path(folder) == root else set())
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip]
        paths += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(paths)


def crossings(path: Path, root: Path = ROOT) -> list[str]:
    """The top-level folders `path` imports that its own may never: tests/ from outside it, the
    harness or a benchmark from the runtime, a benchmark from the harness."""
    module = module_name(path, root)
    never = NEVER.get(module.split(".")[0], set()) | {"tests"}
    found = {name.split(".")[0] for name in imported_modules(path)}
    return sorted(f"{module} imports {top}" for top in found & never)


def test_the_scan_outside_tests_sees_every_top_level_folder():
    tops = {p.relative_to(ROOT).parts[0] for p in outside_tests()}
    assert {"bench", "harness", "shared", "services"} <= tops
    assert "tests" not in tops


@pytest.mark.parametrize("path", outside_tests(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_outside_tests_imports_tests_and_the_runtime_no_harness(path):
    assert crossings(path) == []


def test_the_rule_catches_imports_across_tests_harness_and_bench(tmp_path):
    """The check can fail: a benchmark importing tests/, the runtime importing the harness or a
    benchmark, and the harness importing tests/ are each reported."""
    files = {
        "bench/bad.py": "import tests\nfrom tests.fakes.bus import InMemoryBus\n",
        "shared/engine/bad.py": "from harness.families import build\nimport bench.kv\n",
        "services/decode/bad.py": "from harness import kv_peer\n",
        "harness/bad.py": "from tests import conftest\nfrom bench.kv import prompt_text\n",
        "proto/bad.py": "import tests.unit.test_layout\n",
        "tests/fine.py": "from harness.kv_peer import KVPeer\nimport bench\n",
        ".venv/lib/other.py": "import tests\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [v for path in outside_tests(tmp_path) for v in crossings(path, root=tmp_path)]
    assert found == [
        "bench.bad imports tests",
        "harness.bad imports bench",
        "harness.bad imports tests",
        "proto.bad imports tests",
        "services.decode.bad imports harness",
        "shared.engine.bad imports bench",
        "shared.engine.bad imports harness",
    ]
    # and the layout table keeps a service from the harness too
    assert violations(tmp_path / "services/decode/bad.py", root=tmp_path) == [
        "services.decode.bad imports harness"
    ]


MAX_MODULE_LINES = 300  # a smell detector, not a cap: past it, a module names its one idea below
MAX_FUNCTION_LINES = 45  # "about 40": a few lines of slack for a long signature or docstring
# Split by concept, not by line count. A module over MAX_MODULE_LINES is fine when it holds one
# idea, named here (module -> the idea); two ideas in one file is the smell, and so is one idea
# cut in two to fit. An entry whose module is gone or back within the limit is dropped.
ONE_IDEA = {
    "services/gateway/servicer.py": "the gRPC API: TandemServicer and its methods on a grpc server",
    "services/gateway/settings.py": "the gateway's settings: GatewaySettings, one dataclass",
    "shared/worker/settings.py": "a model worker's settings: WorkerSettings, one dataclass",
    "shared/engine/model_runner.py": "one forward pass of a batch's rows over the paged pool",
    "services/gateway/relay.py": "one request's stream followed across its attempts: RequestRelay",
    "services/scheduler/service.py": "a scheduler replica's loop: admit, place, answer, beat",
}


def runtime_sources(root: Path = ROOT) -> list[Path]:
    """What services run, the generated gRPC stubs aside."""
    paths = [p for folder in ("shared", "services") for p in (root / folder).rglob("*.py")]
    return sorted(p for p in paths if not p.name.startswith("tandem_pb2"))


def long_modules(root: Path = ROOT, one_idea: dict[str, str] = ONE_IDEA) -> list[str]:
    """Each module over MAX_MODULE_LINES that names no idea in `one_idea`, and each entry of
    `one_idea` that is stale: its module gone, or within MAX_MODULE_LINES now."""
    sizes = {p.relative_to(root).as_posix(): _lines(p) for p in runtime_sources(root)}
    found = [
        f"{name}: {n} lines: split it by concept, or name its one idea in ONE_IDEA"
        for name, n in sizes.items()
        if n > MAX_MODULE_LINES and not one_idea.get(name, "").strip()
    ]
    for name in sorted(one_idea):
        if name not in sizes:
            found.append(f"{name}: named in ONE_IDEA, but there is no such module")
        elif sizes[name] <= MAX_MODULE_LINES:
            found.append(f"{name}: named in ONE_IDEA, but {sizes[name]} lines now: drop it")
    return found


def test_a_module_over_300_lines_holds_one_idea_named_in_the_table():
    assert long_modules() == []


def test_the_size_rule_catches_an_unnamed_long_module_and_stale_entries(tmp_path):
    """The check can fail: a long module not in the table, one named with no idea, an entry for a
    module back within the limit and one for a module that is gone are each reported; a long
    module named in the table, a long test and a long generated stub are not."""
    long, short = "x = 1\n" * (MAX_MODULE_LINES + 1), "x = 1\n" * MAX_MODULE_LINES
    files = {
        "services/gateway/big.py": long,
        "services/gateway/blank.py": long,
        "services/gateway/named.py": long,
        "shared/engine/small.py": short,
        "shared/api/tandem_pb2.py": long,
        "tests/unit/test_big.py": long,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    table = {
        "services/gateway/blank.py": " ",
        "services/gateway/named.py": "one idea",
        "shared/engine/small.py": "one idea, once long",
        "shared/control/gone.py": "one idea, since moved",
    }
    assert long_modules(tmp_path, table) == [
        "services/gateway/big.py: 301 lines: split it by concept, or name its one idea in ONE_IDEA",
        "services/gateway/blank.py: 301 lines: split it by concept, or name its one idea in ONE_IDEA",
        "shared/control/gone.py: named in ONE_IDEA, but there is no such module",
        "shared/engine/small.py: named in ONE_IDEA, but 300 lines now: drop it",
    ]


def test_no_function_is_over_about_40_lines():
    long = []
    for path in runtime_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {size}")
    assert long == []


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())
