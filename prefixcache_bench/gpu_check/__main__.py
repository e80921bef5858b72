import sys

from prefixcache_bench.gpu_check.runner import main

sys.exit(main())
