import sys

from bench.pdd.run import main

sys.exit(main())
