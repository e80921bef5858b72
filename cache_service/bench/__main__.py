"""`python -m cache_service.bench`: see the package's docstring, or --help."""
import sys

from cache_service.bench.cli import main

sys.exit(main())
