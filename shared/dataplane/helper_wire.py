"""What a worker and its data-plane helper process say to each other: msgpack maps, each framed
by its length, over a Unix socket pair. Only descriptors travel here (tags, region offsets and
sizes, peer addresses), never KV bytes: those stay in the shared region (shared.engine.shared_region).

Worker -> helper: {"op": "send" | "recv" | "release" | "discard" | "ping", ...}; helper ->
worker: {"ev": "ready" | "reply" | "landed", ...}. A buffer is a ref: [region, offset, nbytes],
a strided ref [region, offset, nbytes, shape, strides] (bytes: some KV heads of a run of pool
blocks), a list of refs a received message is scattered over, or, to send, an assembly
["assemble", nbytes, [[offset, shape, strides, ref], ...]]: a buffer the helper fills part by
part, each part's bytes at its offset, shape and strides (shared.kvtransfer.assembly).
"""

import asyncio
import math
import struct

import msgpack

from shared.engine.shared_region import locate

HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a 128k-token prompt's pieces, posted at once, are well below this

ASSEMBLE = "assemble"

# how a receive ended, in a "landed" item [tag, nbytes, outcome, detail]
LANDED, RELEASED, FAILED = 0, 1, 2


class HelperGone(ConnectionError):
    """The other end closed the socket (the helper or its worker exited)."""


def frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ValueError(f"a {len(body)}-byte helper message is over {MAX_FRAME}")
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> dict:
    """The next message; HelperGone at the end of the stream."""
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_FRAME:
            raise HelperGone(f"a {size}-byte frame is over {MAX_FRAME}: the stream is corrupt")
        message = msgpack.unpackb(await reader.readexactly(size), raw=False)
    except (asyncio.IncompleteReadError, ConnectionError) as err:
        raise HelperGone(str(err) or "end of stream") from None
    if not isinstance(message, dict):
        raise HelperGone("a frame that is not a map")
    return message


def strided_ref(regions, address: int, itemsize: int, shape: list[int], strides: list[int]) -> list:
    """The ref of a strided view (its last dimension contiguous) of `itemsize`-byte elements,
    `strides` in elements: its shape and strides in bytes, the last dimension widened to bytes."""
    if strides[-1] != 1:
        raise ValueError("a strided KV buffer's last dimension must be contiguous")
    shape_b = [*shape[:-1], shape[-1] * itemsize]
    strides_b = [*(s * itemsize for s in strides[:-1]), 1]
    extent = 1 + sum((n - 1) * s for n, s in zip(shape_b, strides_b))
    region, offset = locate(regions, address, extent)
    return [region, offset, math.prod(shape_b), shape_b, strides_b]
