"""Worker for launcher tests: write ``<outdir>/rank-<RANK>.json`` with what the worker saw.

The file holds the worker's rank variables and every ``NANSENTINEL_*`` and
``TORCHELASTIC_*`` variable, so a test can assert both the set of ranks and the environment
the launcher passed down. With ``--fail-first``, rank 0 exits 1 in the first attempt, so
the test also sees torchrun restart the group (``--max-restarts``) through the launcher.
"""

import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[1])
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
if "--fail-first" in sys.argv[2:] and os.environ["RANK"] == "0" and first_attempt:
    sys.exit(1)
seen = {k: v for k, v in os.environ.items() if k.startswith(("NANSENTINEL_", "TORCHELASTIC_"))}
seen.update({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")})
(out / f"rank-{os.environ['RANK']}.json").write_text(json.dumps(seen))
