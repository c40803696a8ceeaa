"""Reading an HTTP request's body: bounded in size, and not kept past its parse."""

from aiohttp import web

BODY_CHUNK = 64 * 1024


class BodyTooLarge(ValueError):
    """A request body over the gateway's limit (413)."""


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes (BodyTooLarge past it, by its Content-Length
    before a byte is read, or while reading one that has none). Read here rather than by
    aiohttp's request.read(), which keeps the bytes for as long as the request lives."""
    too_large = BodyTooLarge(f"the body is over the {limit}-byte limit")
    if (request.content_length or 0) > limit:
        raise too_large
    body = bytearray()
    while chunk := await request.content.read(BODY_CHUNK):
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)
