"""`python -m compute_service.bench_tiers`: see the package's docstring, or --help."""
import sys

from compute_service.bench_tiers.cli import main

sys.exit(main())
