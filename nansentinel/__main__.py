"""``python -m nansentinel`` is the ``nansentinel`` command."""

import sys

from nansentinel.cli import main

sys.exit(main())
