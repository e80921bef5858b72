"""`python -m prefixcache_bench.cache`: see the package's docstring, or --help."""
import sys

from prefixcache_bench.cache.cli import main

sys.exit(main())
