"""``python -m ringray ...``: the ``ringray`` command without relying on its console script
(a Ray cluster's Python may not have it on PATH)."""

from ringray.cli import main

main()
