"""`python -m services.prefill`: one prefill worker."""

import sys

from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillWorker
from shared.worker.main import worker_main


def build(settings, runtime, bus, plane, liveness) -> PrefillWorker:
    return PrefillWorker(settings, runtime, bus, plane)


def main(argv=None) -> int:
    return worker_main(PrefillSettings, "prefill", build, argv)


if __name__ == "__main__":
    sys.exit(main())
