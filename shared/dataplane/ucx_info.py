"""What UCX chose: the lanes of an endpoint, read through UCX's own printer."""

import ctypes
import functools
import glob
import logging
import os
import re
import weakref

log = logging.getLogger(__name__)


@functools.cache
def _libraries():
    import libucx

    pattern = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so*")
    libc = ctypes.CDLL("libc.so.6")
    libc.open_memstream.restype = ctypes.c_void_p
    return ctypes.CDLL(sorted(glob.glob(pattern))[0]), libc


def endpoint_lanes(ucp_endpoint: int) -> list[str]:
    """The lanes of a UCX endpoint as `ucp_ep_print_info` prints them ("sysv/memory am keepalive", ...).

    ucxx has no binding for it, so it is called through ctypes on the library ucxx loaded."""
    try:
        libucp, libc = _libraries()
        text, size = ctypes.c_char_p(), ctypes.c_size_t()
        stream = libc.open_memstream(ctypes.byref(text), ctypes.byref(size))
        libucp.ucp_ep_print_info(ctypes.c_void_p(ucp_endpoint), ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        info = ctypes.string_at(text, size.value).decode(errors="replace")
        libc.free(text)
    except Exception as err:  # introspection only: never fail a transfer over it
        log.debug("UCX endpoint info unavailable: %s", err)
        return []
    return parse_lanes(info)


def parse_lanes(info: str) -> list[str]:
    """ "transport/device roles" of every lane line of `ucp_ep_print_info` output."""
    lanes = []
    for line in info.splitlines():
        match = re.search(r"lane\[\d+\]:\s*\d+:(\S+?)(?:\.\d+)?\s.*?seg \d+\s*(.*)$", line)
        if match:
            lanes.append(f"{match.group(1)} {match.group(2)}".strip())
    return lanes


def transport_summary(lanes: list[str]) -> str:
    """ "sysv+posix+cma" style: each lane's transport once, in lane order."""
    names = []
    for lane in lanes:
        name = lane.split()[0].split("/")[0]
        if name not in names:
            names.append(name)
    return "+".join(names) if names else "unknown"


def never_close(ep) -> None:
    """Detaches the finalizer ucxx gives every endpoint: it would close it at exit, blocking for
    ever on one whose peer is gone."""
    for finalizer in list(weakref.finalize._registry):  # no public handle to it
        info = finalizer.peek()
        if info is not None and info[0] is ep:
            finalizer.detach()


def active_transports(ucxx) -> str:
    try:
        return str(ucxx.get_active_transports())
    except Exception as err:  # older ucxx builds lack it
        return f"unknown ({err})"
