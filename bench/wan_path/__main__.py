from bench.wan_path.run import main

raise SystemExit(main())
