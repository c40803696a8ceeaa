"""Every use of ucxx beyond its public API, in one place, and the check that it is all there.

The KV plane needs more than ucxx's public calls: the UCX worker itself (a tag receive per piece
without a task each; progress and arming from our event loop), its address and buffer types, the
context's tag probe, and ucxx's per-loop registry of progress tasks, where our progress driver
(shared.dataplane.ucx_progress) takes the place of ucxx's own "blocking" one. All of it is private
to ucxx and has changed between releases: 0.45 has no `_tasks` on its progress tasks (workers
crash-looped with "'BlockingMode' object has no attribute '_tasks'"), 0.46 no tag probe on the
context (release() fails; nor does its worker address have tobytes(), which came in 0.50, so
bytes() is used). `check()` runs where the UCX plane starts and in the image build
(`python -m shared.dataplane.ucxx_compat`), so an incompatible ucxx fails there, naming its version
and the supported range, not at the first transfer.
"""

import asyncio
import importlib
import logging
import sys

import numpy

log = logging.getLogger(__name__)

MINIMUM = (0, 47)  # the oldest release the KV data plane tests pass with
NEWEST_TESTED = (0, 52)  # newer ones are checked name by name, and a warning logged
SUPPORTED = (
    "ucxx >=0.47 (tested 0.47 to 0.52): ucxx-cu12 or ucxx-cu13, see deploy/constraints-*.txt"
)

# (module, dotted name) that must resolve: everything below relies on them.
REQUIRED = [
    ("ucxx.core", "_get_ctx"),
    ("ucxx._lib_async.application_context", "ProgressTasks"),
    ("ucxx._lib_async.application_context", "ApplicationContext.tag_probe"),
    ("ucxx._lib_async.application_context", "ApplicationContext.recv_with_handle"),
    ("ucxx._lib_async.continuous_ucx_progress", "ProgressTask._tasks"),
    ("ucxx._lib_async.endpoint", "Endpoint.ucp_endpoint"),
    ("ucxx._lib.libucxx", "UCXAddress.create_from_buffer"),
    ("ucxx._lib.libucxx", "UCXEndpoint.tag_send"),
    ("ucxx._lib.libucxx", "UCXWorker.tag_recv"),
    ("ucxx._lib.libucxx", "UCXWorker.progress_once"),
    ("ucxx._lib.libucxx", "UCXWorker.arm"),
    ("ucxx._lib.libucxx", "UCXWorker.epoll_file_descriptor"),
    ("ucxx._lib.arr", "Array"),
    ("ucxx.types", "Tag"),
]


class IncompatibleUcxx(RuntimeError):
    """The installed ucxx lacks what the KV data plane drives (or is not installed)."""


def version() -> str:
    import ucxx

    return str(ucxx.__version__)


def parse_version(text: str) -> tuple[int, int]:
    """ "0.52.00" -> (0, 52)."""
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def missing_names() -> list[str]:
    """The REQUIRED names that the installed ucxx does not have."""
    missing = []
    for module_name, dotted in REQUIRED:
        try:
            found = importlib.import_module(module_name)
            for part in dotted.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{dotted}")
    return missing


def check() -> str:
    """The installed ucxx's version, if it can drive the KV data plane; else IncompatibleUcxx,
    naming that version, what is wrong and the supported range."""
    try:
        installed = version()
    except ImportError as err:
        raise IncompatibleUcxx(f"ucxx cannot be imported ({err}); supported: {SUPPORTED}") from err
    problems = []
    if parse_version(installed) < MINIMUM:
        problems.append(f"older than {'.'.join(map(str, MINIMUM))}")
    missing = missing_names()
    if missing:
        problems.append("missing " + ", ".join(missing))
    if problems:
        raise IncompatibleUcxx(
            f"ucxx {installed} cannot drive the KV data plane ({'; '.join(problems)}); "
            f"supported: {SUPPORTED}"
        )
    if parse_version(installed) > NEWEST_TESTED:
        log.warning("ucxx %s is newer than any tested (%s)", installed, SUPPORTED)
    return installed


def _context():
    import ucxx

    return ucxx.core._get_ctx()


def worker():
    """The UCX worker of ucxx's application context (after ucxx.init)."""
    return _context().worker


def worker_address() -> bytes:
    """This worker's address, as peers are told it (after ucxx.init)."""
    import ucxx

    return bytes(ucxx.get_worker_address())  # tobytes() only from 0.50


def address(buffer: bytes):
    """A peer's worker address, from the bytes it announced."""
    from ucxx._lib.libucxx import UCXAddress

    return UCXAddress.create_from_buffer(buffer)


def buffer(view):
    """What a tag request reads or writes; keep it alive until the request completes."""
    from ucxx._lib.arr import Array

    return Array(view)


def tag_sends(endpoint, views: list, tags: list[int]) -> tuple[list, list]:
    """(buffers, requests): a send request per (view, tag), the lookups done once for all (a
    piece costs microseconds of Python, and a prompt's KV is hundreds of pieces)."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag

    send = endpoint._ep.tag_send
    buffers = [Array(view) for view in views]
    return buffers, [send(data, Tag(tag)) for data, tag in zip(buffers, tags)]


def tag_recv(data, tag: int):
    """A UCX receive request posted on the worker (no task per message)."""
    from ucxx.types import Tag

    return worker().tag_recv(data, Tag(tag))


async def take_message(tag: int) -> int | None:
    """Takes the message waiting with this tag off the wire; its length, or None if none waits."""
    ctx = _context()
    probe = ctx.tag_probe(tag, remove=True)
    if not probe.matched:
        return None
    await ctx.recv_with_handle(numpy.empty(max(1, probe.length), dtype=numpy.uint8), probe)
    return probe.length


class _Registered:
    """What ucxx's per-loop registry holds for a loop we drive: it only asks whether a loop has
    an entry, but entries are progress tasks, whose protocol (since 0.46) is `_tasks` and
    `_clear_tasks`."""

    def __init__(self, progress):
        self.progress = progress

    @property
    def _tasks(self) -> tuple:
        return self.progress.tasks()

    def _clear_tasks(self) -> None:
        self.progress.stop()


def replace_progress(loop: asyncio.AbstractEventLoop, start):
    """Stops the progress task ucxx.init(progress_mode="blocking") started on `loop` (its epoll
    reader and its tasks), then `start(worker)`s ours (an object with tasks() and stop()) and
    registers it in its place, so ucxx starts no other one on this loop. Returns ours."""
    from ucxx._lib_async import application_context

    theirs = application_context.ProgressTasks.pop(loop, None)
    if theirs is not None:
        loop.remove_reader(worker().epoll_file_descriptor)
        for task in theirs._tasks:
            if task is not None:
                task.cancel()
    progress = start(worker())
    application_context.ProgressTasks[loop] = _Registered(progress)
    return progress


def main() -> int:
    try:
        print(f"ucxx {check()}: compatible")
    except IncompatibleUcxx as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
