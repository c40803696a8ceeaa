"""Tandem's CPU kernels (csrc/): decode attention over the paged pool and the fused elementwise
ops between a layer's GEMMs. Compiled on first use for this CPU (-march=native) and cached in
torch's extension cache (`TORCH_EXTENSIONS_DIR`); `make kernels` builds them ahead.

Where they cannot be built (no C++ compiler) `load()` returns None, with a warning, and the
model runner keeps the plain torch path; on CUDA they are not used. Where the cache cannot be
written (an image's, under a read-only root filesystem) and holds no build for this CPU, they are
built in the temporary directory instead, again at every start, with a warning.

    python -m shared.engine.kernels     build (or find) them; fails loudly if they cannot be built
"""

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# -ffp-contract=off: the elementwise ops round each product as torch's one-op-at-a-time code does;
# no errno, no FP traps (as torch builds): what lets the exp and rounding loops vectorize.
CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
]
_loaded: dict[str, object] = {}


def cpu_flags() -> str:
    """The CPU's feature list (x86 `flags`, ARM `Features`), or what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return platform.machine() + line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _ninja_on_path() -> None:
    """torch builds with the `ninja` found on PATH; the one pip installed sits in the venv's bin,
    which is not on PATH unless the venv is activated."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def module_name() -> str:
    """Unique per source, flags, CPU and torch: the build is for this CPU only."""
    digest = hashlib.sha256()
    for source in sorted(CSRC.glob("*.[ch]*")):
        digest.update(source.read_bytes())
    digest.update((" ".join(CFLAGS) + cpu_flags() + torch.__version__).encode())
    return "tandem_kernels_" + digest.hexdigest()[:16]


def build_directory(name: str) -> Path:
    """torch's extension cache for `name`; where that cannot be made, a directory of the
    temporary one (a read-only image: its cache holds the builds for the CPU it was built on)."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(name, False))
    except OSError as err:
        scratch = Path(tempfile.gettempdir()) / "tandem-kernels" / name
        log.warning(
            "no CPU kernels for this CPU in torch's extension cache, which cannot be written "
            "(%s): building them in %s, at every start",
            err,
            scratch,
        )
        scratch.mkdir(parents=True, exist_ok=True)
        return scratch


def _import_built(name: str, directory: Path):
    """The module if this exact build is in `directory` already: imported directly, without
    torch's build check, which runs ninja in a subprocess (a fork in a worker that has gRPC's
    threads running, which has crashed one at start-up)."""
    path = directory / f"{name}.so"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The compiled kernel module, or None when it cannot be built here."""
    name = module_name()
    if name not in _loaded:
        from torch.utils import cpp_extension

        try:
            directory = build_directory(name)
            _loaded[name] = _import_built(name, directory)
            if _loaded[name] is not None:
                return _loaded[name]
            _ninja_on_path()
            # libgomp resolves to the copy torch already loaded: one OpenMP runtime, torch's threads.
            _loaded[name] = cpp_extension.load(
                name=name,
                sources=[str(s) for s in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
        except Exception as error:  # no compiler, no ninja, a broken toolchain: keep the torch path
            log.warning("CPU kernels unavailable (%s); using plain torch ops", error)
            _loaded[name] = None
    return _loaded[name]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if load() is None:
        raise SystemExit("the CPU kernels could not be built (is a C++ compiler installed?)")
    print("CPU kernels ready:", module_name())
