"""Which worker roles a scheduler's mode needs: to hold a request's sequence (decode_roles), to
be ready (a live worker in every pool the mode uses), and to serve a request at all (missing:
what a replica lacks, when it should stand aside; see Intake)."""

from services.scheduler.registry import WorkerRegistry


def decode_roles(mode: str) -> tuple[str, ...]:
    """The roles of the workers that hold a request's sequence in `mode`."""
    return {"colocated": ("colocated",), "disaggregated": ("decode",)}.get(
        mode, ("decode", "colocated")
    )


def ready(registry: WorkerRegistry, mode: str) -> bool:
    """A live worker in every pool the mode uses (auto: a decode or colocated one is enough)."""
    pools = [("prefill",), ("decode",)] if mode == "disaggregated" else [decode_roles(mode)]
    return all(any(registry.live(role) for role in roles) for roles in pools)


def missing(registry: WorkerRegistry, mode: str, prefill_fallback: str) -> str:
    """What keeps this replica from serving any request ("": nothing): no live worker of the
    roles that hold sequences; or, disaggregated, no live prefill worker while the fallback does
    not prefill on the decode worker (wait, fail)."""
    roles = decode_roles(mode)
    if not any(registry.live(role) for role in roles):
        return f"no live {' or '.join(roles)} worker"
    if mode == "disaggregated" and prefill_fallback != "local" and not registry.live("prefill"):
        return f"no live prefill worker (prefill_fallback={prefill_fallback})"
    return ""
