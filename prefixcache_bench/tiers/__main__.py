"""`python -m prefixcache_bench.tiers`: see the package's docstring, or --help."""
import sys

from prefixcache_bench.tiers.cli import main

sys.exit(main())
