"""``python -m ringray ...``: the ``ringray`` command without relying on its console script
(a Ray cluster's Python may not have it on PATH; ``ringray submit`` runs jobs this way).

A third-party module this Python lacks ends the command with one line that names the module
and what brings it, instead of a traceback: on a cluster that line is the job's log, and the
last line ``ringray status`` shows.
"""

from __future__ import annotations

import sys

# Import names whose pip package is called otherwise (the rest: "_" becomes "-").
_PIP_NAMES = {"yaml": "pyyaml", "PIL": "pillow"}


def missing_module_line(module: str, python: str) -> str:
    """The one line for a missing third-party ``module`` of the Python at ``python``."""
    from ringray.cluster.jobs import CLUSTER_PROVIDED  # stdlib-only until Ray is used

    top = module.split(".")[0]
    if top in CLUSTER_PROVIDED:
        return (f"error: ringray needs the Python module {top!r}, which {python} lacks: the "
                f"cluster must provide {top} itself, in the version it runs (ringray submit "
                f"never installs {', '.join(sorted(CLUSTER_PROVIDED))})")
    package = _PIP_NAMES.get(top, top.replace("_", "-"))
    return (f"error: ringray needs the Python module {top!r}, which {python} lacks: submit "
            f"without --no-pip (the job then installs ringray's dependencies) or add --pip "
            f"{package}; outside a job: pip install {package}")


def main() -> None:
    """Run the command line; a missing third-party module is one line and exit code 2."""
    try:
        from ringray.cli import main as cli_main

        cli_main()
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "ringray":
            raise  # a module of ringray's own that is missing is a bug, not the environment
        print(missing_module_line(exc.name, sys.executable), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
