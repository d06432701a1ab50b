"""``python -m kf.evaluation.runner FD PARENT_PID``: a runner process (see
:mod:`kf.evaluation.runner.loop`)."""

import sys

from kf.evaluation.runner.loop import Runner, main

__all__ = ["Runner", "main"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
