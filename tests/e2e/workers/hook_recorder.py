"""An --on-exclude hook for the tests: writes ``host|reason`` (its arguments) to OUT, and
checks that the environment variables carry the same text (inside the arguments, which the
template may have decorated, e.g. ``"excluded-{host}"``)."""

import os
import sys
from pathlib import Path

out, host, reason = sys.argv[1], sys.argv[2], sys.argv[3]
env_host = os.environ["NANSENTINEL_EXCLUDED_HOST"]
env_reason = os.environ["NANSENTINEL_EXCLUSION_REASON"]
if env_host not in host or env_reason not in reason:
    sys.exit(f"arguments {host!r}, {reason!r} differ from the environment {env_host!r}, "
             f"{env_reason!r}")
Path(out).write_text(f"{host}|{reason}", encoding="utf-8")
