from ocache.cli import main

raise SystemExit(main())
