"""``python -m vcluster``: the same as the ``vcluster`` command."""

import sys

from vcluster.cli.main import main

sys.exit(main())
