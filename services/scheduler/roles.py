"""Which worker roles a scheduler's mode needs: to hold a request's sequence (decode_roles), to
be ready (a live worker in every pool the mode uses), and to serve a request at all (missing:
what a replica lacks, when it should stand aside; see Intake)."""

from services.scheduler.registry import WorkerRegistry
from shared.control.worker_roles import Mode, Role


def decode_roles(mode: Mode) -> tuple[Role, ...]:
    """The roles of the workers that hold a request's sequence in `mode`."""
    return {Mode.COLOCATED: (Role.COLOCATED,), Mode.DISAGGREGATED: (Role.DECODE,)}.get(
        mode, (Role.DECODE, Role.COLOCATED)
    )


def ready(registry: WorkerRegistry, mode: Mode) -> bool:
    """A live worker in every pool the mode uses (auto: a decode or colocated one is enough)."""
    pools = (
        [(Role.PREFILL,), (Role.DECODE,)] if mode == Mode.DISAGGREGATED else [decode_roles(mode)]
    )
    return all(any(registry.live(role) for role in roles) for roles in pools)


def missing(registry: WorkerRegistry, mode: Mode, prefill_fallback: str) -> str:
    """What keeps this replica from serving any request ("": nothing): no live worker of the
    roles that hold sequences; or, disaggregated, no live prefill worker while the fallback does
    not prefill on the decode worker (wait, fail)."""
    roles = decode_roles(mode)
    if not any(registry.live(role) for role in roles):
        return f"no live {' or '.join(roles)} worker"
    if (
        mode == Mode.DISAGGREGATED
        and prefill_fallback != "local"
        and not registry.live(Role.PREFILL)
    ):
        return f"no live prefill worker (prefill_fallback={prefill_fallback})"
    return ""
