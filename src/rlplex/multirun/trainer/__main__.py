"""`python -m rlplex.multirun.trainer`: the standalone, torchrun-style trainer (see `main`)."""

from rlplex.multirun.trainer.main import main

raise SystemExit(main())
