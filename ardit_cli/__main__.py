"""``python -m ardit_cli``: the same as the ``ardit`` command."""

import sys

from ardit_cli.main import main

sys.exit(main())
