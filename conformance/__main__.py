from conformance.cli.commands import main

raise SystemExit(main())
