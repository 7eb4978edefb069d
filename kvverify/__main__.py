from kvverify.cli import main

raise SystemExit(main())
