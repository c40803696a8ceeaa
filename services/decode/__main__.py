"""`python -m services.decode`: one decode worker (or, with --colocated, a colocated worker)."""

import sys

from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeWorker
from shared.worker.main import worker_main


def main(argv=None) -> int:
    return worker_main(DecodeSettings, "decode", DecodeWorker, argv, with_liveness=True)


if __name__ == "__main__":
    sys.exit(main())
