"""``python -m adaptis`` is the ``adaptis`` command."""

from adaptis.cli import main

raise SystemExit(main())
