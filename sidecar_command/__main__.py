"""``python -m sidecar_command``: the same as the ``sidecar`` console script."""

from sidecar_command import main

raise SystemExit(main())
