"""`python -m appliance.bench`: the bench's command line (bench/cli.py)."""

import sys

from appliance.bench.cli import main

sys.exit(main())
