"""`python -m compute_service.bench`: see the package's docstring, or --help."""
import sys

from compute_service.bench.cli import main

sys.exit(main())
