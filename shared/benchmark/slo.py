"""Service-level objectives, and whether one request met them (the basis of goodput).

A request meets the SLO when it completed and, for every objective given:
  ttft_ms  its time to first token is at most the value;
  tpot_ms  its time per output token (after the first) is at most the value;
  itl_ms   its *largest* inter-token latency is at most the value (no gap longer than that;
           a response with n tokens counts as n gaps of 1/n of its wait, see metrics.itl_ms);
  e2e_ms   its end-to-end latency is at most the value.
A request with a single output token has no TPOT or ITL: those objectives cannot fail it.
"""

from dataclasses import asdict, dataclass, fields

SLO_HELP = (
    "service-level objectives for goodput, any of ttft_ms, tpot_ms, itl_ms, e2e_ms, e.g. "
    "ttft_ms=500,itl_ms=50: a request counts when it completed with TTFT, TPOT and E2E at most "
    "these and its largest inter-token latency at most itl_ms"
)


class SLOError(ValueError):
    pass


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """`ttft_ms=500,itl_ms=50`: any subset of the four, each a positive number of milliseconds."""
        known = {f.name for f in fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() not in known:
                raise SLOError(
                    f"{item!r}: expected one of {', '.join(sorted(known))} as name=milliseconds"
                )
            try:
                values[key.strip()] = float(value)
            except ValueError:
                raise SLOError(f"{item!r}: {value!r} is not a number") from None
            if not values[key.strip()] > 0:
                raise SLOError(f"{item!r}: an objective must be a positive number of milliseconds")
        return cls(**values)

    def given(self) -> dict[str, float]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def met(
        self,
        ttft_ms: float | None,
        tpot_ms: float | None,
        max_itl_ms: float | None,
        e2e_ms: float | None,
    ) -> bool:
        """Whether a completed request's latencies meet every objective given (None: not measured)."""
        return (
            _within(ttft_ms, self.ttft_ms)
            and _within(tpot_ms, self.tpot_ms)
            and _within(max_itl_ms, self.itl_ms)
            and _within(e2e_ms, self.e2e_ms)
        )


def _within(value: float | None, limit: float | None) -> bool:
    return limit is None or value is None or value <= limit
