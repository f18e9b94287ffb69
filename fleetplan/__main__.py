"""`python -m fleetplan ...` is the `fleetplan` command."""

from fleetplan.harness.cli import main

raise SystemExit(main())
