import sys

from bench.billing.run import main

sys.exit(main())
