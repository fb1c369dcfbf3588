from stemdeck_watch.cli import main

raise SystemExit(main())
