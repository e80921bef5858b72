"""`python -m prefixcache_bench.compute`: see the package's docstring, or --help."""
import sys

from prefixcache_bench.compute.cli import main

sys.exit(main())
