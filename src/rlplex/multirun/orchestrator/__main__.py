"""`python -m rlplex.multirun.orchestrator OUTPUT_DIR RUN_ID ORCH.toml` (see `loop.main`)."""

import sys

from rlplex.multirun.orchestrator.loop import main

sys.exit(main())
