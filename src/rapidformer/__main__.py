"""``python -m rapidformer``: same as the ``rapidformer`` command."""

import sys

from rapidformer.cli import main

sys.exit(main())
