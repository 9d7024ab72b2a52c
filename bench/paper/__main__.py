from bench.paper.run import main

raise SystemExit(main())
