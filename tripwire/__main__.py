from tripwire.core.cli import main

raise SystemExit(main())
