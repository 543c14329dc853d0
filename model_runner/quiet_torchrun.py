"""``python -m model_runner.quiet_torchrun ARGS``: torchrun (``torch.distributed.run``) for the
serving ranks, with the launcher in charge of what the user sees.

It is torchrun itself, with three differences:
- a rank that fails ends it with the rank's exit code, not a traceback and a failure report:
  the rank has already printed its own one-line ``error:`` message;
- a stop signal (SIGHUP, SIGQUIT) stops the ranks and exits ``128 + signal`` quietly;
- SIGINT and SIGTERM are not its business: dasc-serve starts it with both ignored (so are its
  ranks) and stops the ranks in order through the scheduler, so a signal sent to the whole
  process group is handled by the launcher alone.
torch elastic's own logging is kept to critical messages.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("LOGLEVEL", "CRITICAL")  # read by the loggers torch.distributed.run makes
    # torchrun's --signals-to-handle (PET_ env), and the variable older versions read directly
    for name in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        os.environ[name] = "SIGHUP,SIGQUIT"
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)

    try:
        run.main(argv)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
