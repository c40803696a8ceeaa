"""InvalidRequest: a request the gateway refuses as it is (INVALID_ARGUMENT; HTTP 400)."""


class InvalidRequest(ValueError):
    pass
