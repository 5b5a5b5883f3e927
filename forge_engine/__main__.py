from forge_engine.cli import main

raise SystemExit(main())
