"""The folders are the architecture: each package imports only what the README's layout table
allows. The library never imports a service, services never import each other, and nothing in the
runtime path imports the `tandem` command, the benchmark client or a test fake."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMON = {
    "shared.settings",
    "shared.lifecycle",
    "shared.model_store",
    "shared.telemetry",
    "shared.values",
}  # leaves
RUNTIME = {
    "shared.values",
    "shared.control",
    "shared.engine",
    "shared.dataplane",
    "shared.kvtransfer",
    "shared.worker",
    "shared.api",
}
# package -> the packages of ours it may import (itself always)
ALLOWED = {
    "shared.values": set(),  # what the engine and the control plane share: imports neither
    "shared.control": {"shared.telemetry", "shared.values"},
    "shared.api": set(),
    "shared.settings": {"shared.telemetry"},
    "shared.lifecycle": set(),
    "shared.model_store": set(),
    "shared.telemetry": set(),
    "shared.engine": {"shared.values"},  # no wire message
    "shared.dataplane": {"shared.engine"},  # transports only: no control message
    "shared.kvtransfer": {
        "shared.control",
        "shared.engine",
        "shared.dataplane",
        "shared.telemetry",
    },
    "shared.worker": {"shared.control", "shared.engine", "shared.dataplane", "shared.kvtransfer"}
    | COMMON,
    "shared.benchmark": {"shared.api"},
    "shared.cli": RUNTIME | COMMON | {"shared.benchmark"},
    "services.gateway": RUNTIME | COMMON,
    "services.scheduler": (RUNTIME | COMMON) - {"shared.engine"},  # places, never batches
    "services.prefill": RUNTIME | COMMON,
    "services.decode": RUNTIME | COMMON,
    "tests.fakes": RUNTIME | COMMON,
}


def package_of(module: str) -> str | None:
    """The layout unit a dotted module name belongs to: `shared.<x>`, `services.<x>`, `tests.<x>`."""
    parts = module.split(".")
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
    folders = [ROOT / "shared", ROOT / "services", ROOT / "tests" / "fakes"]
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
    for top in ("shared", "services"):
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


MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 45  # "about 40": a few lines of slack for a long signature or docstring


def runtime_sources() -> list[Path]:
    """What services run, the generated gRPC stubs aside."""
    paths = [p for folder in ("shared", "services") for p in (ROOT / folder).rglob("*.py")]
    return sorted(p for p in paths if not p.name.startswith("tandem_pb2"))


def test_no_module_is_over_300_lines():
    long = [
        f"{p.relative_to(ROOT)}: {n}"
        for p in runtime_sources()
        if (n := _lines(p)) > MAX_MODULE_LINES
    ]
    assert long == []


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
