"""What a model worker does (Role) and which roles a scheduler routes to (Mode).

Both are string enums: a member is its value wherever it goes (str(), f-strings, msgpack, JSON,
protobuf string fields, metrics labels, environment variables), so the wire and every output read
"prefill", "disaggregated", ... as before. A member also equals its value (Role.PREFILL ==
"prefill"), so a role or mode built in-process from a plain string compares the same.
"""

import enum


class Role(enum.StrEnum):
    """A worker's role, as its heartbeats announce it."""

    PREFILL = "prefill"  # computes prompts and sends their KV to a decode worker
    DECODE = "decode"  # holds sequences; prefills short prompts itself in auto mode
    COLOCATED = "colocated"  # prefills and decodes every request itself, no KV transfer


class Mode(enum.StrEnum):
    """Where a scheduler has prompts computed (see services.scheduler.router)."""

    AUTO = "auto"  # on a prefill worker, or on the decode worker when that is cheaper
    DISAGGREGATED = "disaggregated"  # always on a prefill worker
    COLOCATED = "colocated"  # on colocated workers only
