"""`python -m jaxspeed.cli ...`: the `jaxspeed` console script, with its exit code."""

from jaxspeed.cli import main

raise SystemExit(main())
