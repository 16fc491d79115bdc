from mpifl.cli import main

raise SystemExit(main())
