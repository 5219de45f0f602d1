"""``python -m ringray.harness [--cp N] -- <lm_eval arguments>`` (:mod:`ringray.harness.launch`)."""

import sys

from ringray.harness.launch import main

if __name__ == "__main__":
    sys.exit(main())
